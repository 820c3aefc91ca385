//! Blocks between nodes over TCP: several connections per peer, slices
//! striped across them and pipelined, sent straight from the sender's
//! slots (`writev` of frame header and slot bytes, many frames a call),
//! received straight into the target slot, checked there before the `Ack`.
//!
//! No thread and no runtime of its own: [`TcpTransport::poll`] is driven by
//! the caller's loop (non-blocking sockets under one `mio::Poll`, asked
//! with a zero timeout). Connections are outbound (this end's writes go
//! out, their acks come back) or inbound (a peer's writes come in, this
//! end's acks go back).
//!
//! A connection that breaks fails what depended on it — each transfer
//! that had a slice on it (sender), each block that was landing through
//! it (receiver: given back through [`Landing::abandoned`]) — with a clear
//! error; it is reconnected with backoff. Nothing waits past a transfer's
//! deadline.
//!
//! With a link key ([`TcpTransport::authenticate`]) every connection opens
//! with the handshake of [`crate::auth`] and every frame carries its two
//! tags after its header: a frame whose header tag fails is not acted on,
//! a slice whose bytes fail theirs never counts toward its block (the
//! block is given back unpublished); either closes the connection, and is
//! counted and logged ([`TcpTransport::take_security_events`]).

use std::collections::HashMap;
use std::io::{ErrorKind, IoSlice, Read, Write};
use std::net::SocketAddr;

use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token};

use super::frame::{
    AckStatus, BlockAddr, FEATURE_TENANT, FEATURE_TRACE, FEATURES_LEN, FEATURES_SPOKEN, FRAME_HEADER_BYTES, Features,
    FrameError, FrameHeader, FrameKind,
};
use super::{ANY_SLOT, Completion, Landing, TransferError};
use crate::auth::handshake::{CLIENT_FINISH_BYTES, CLIENT_HELLO_BYTES, SERVER_HELLO_BYTES};
use crate::auth::{AuthError, ClientHandshake, Later, LinkKey, PayloadCheck, ServerHandshake, Session, TAGS_BYTES};
use crate::model::replica::Priority;

/// How a transport is set up.
#[derive(Clone, Copy, Debug)]
pub struct TcpConfig {
    /// Connections to each peer (slices are striped across them); at most
    /// [`STREAMS_PER_PEER_MAX`].
    pub streams_per_peer: usize,
    /// Bytes of a slice: a larger block goes as several, over several
    /// connections.
    pub slice_bytes: u32,
    /// A transfer not acknowledged by then fails (`Timeout`).
    pub transfer_timeout_ns: u64,
    /// Transfers in flight at most (a write past it is refused `Busy`).
    pub in_flight_max: usize,
    /// Blocks landing at once at most, from all peers.
    pub landing_max: usize,
    /// First wait before reconnecting a broken connection (doubles, to
    /// 64 times this).
    pub reconnect_ns: u64,
    /// A connection with bytes to move that moves none for this long (no
    /// byte written or read, nothing acknowledged by the peer's kernel —
    /// a cut link, a dead host) is treated as broken; one not up this long
    /// after its connect is given up.
    pub stall_ns: u64,
    /// On authenticated links, where the process spreads tags over threads
    /// ([`crate::auth::spread_tags`]): a large slice's tags are made, and a
    /// received one's checked, on those threads while the connection moves
    /// other frames (a block lands once all its slices checked). Off: the
    /// polling thread waits for each.
    pub tags_later: bool,
    /// What this end offers (outbound connections) and takes (inbound)
    /// beyond the frames every build reads ([`FEATURES_SPOKEN`]: trace
    /// ids). 0: none — no offer made, every offer declined, as a build
    /// before features did.
    pub features: u64,
}

impl Default for TcpConfig {
    fn default() -> Self {
        Self {
            streams_per_peer: 4,
            slice_bytes: 1 << 20,
            transfer_timeout_ns: 10_000_000_000,
            in_flight_max: 4096,
            landing_max: 4096,
            reconnect_ns: 10_000_000,
            stall_ns: 2_000_000_000,
            tags_later: true,
            features: FEATURES_SPOKEN,
        }
    }
}

/// Connections to one peer at most.
pub const STREAMS_PER_PEER_MAX: usize = 64;

/// Frames one `writev` takes at most (two slices each).
const FRAMES_PER_WRITE: usize = 32;

/// Bytes of a connection's receive buffer (headers and small slices are
/// read through it; large slices straight into their target).
const RECV_BUFFER_BYTES: usize = 256 * 1024;

/// A slice bigger than this whose bytes are not in the buffer yet is read
/// straight into its target.
const DIRECT_READ_MIN: usize = 16 * 1024;

/// Bytes a buffered read asks for after a large slice (the next header and
/// a little more).
const SMALL_READ_BYTES: usize = 4096;

/// Bytes before a frame's slice on an authenticated connection: the
/// header, then its tags.
const SEALED_PREFIX_BYTES: usize = FRAME_HEADER_BYTES + TAGS_BYTES;

/// Bytes of frames sealed ahead of what a connection has written, at most
/// (past one frame): tags are made just before their frame goes out, in
/// the order frames go out.
const SEAL_AHEAD_BYTES: usize = 2 << 20;

/// Inbound connections that have not finished their handshake, at most;
/// more are closed as they come.
const HANDSHAKING_MAX: usize = 64;

/// Security events kept for the caller to log, at most (older ones are
/// counted and dropped).
const SECURITY_EVENTS_MAX: usize = 64;

/// Negotiation frames one connection carries at most (their bytes are
/// kept with it while it lives); a peer that sends more is cut off.
const NEGOTIATIONS_PER_STREAM_MAX: usize = 16;

/// Negotiations waiting for the owner to take them, at most; a frame
/// past it cuts its connection off (the owner takes them every poll).
const NEGOTIATIONS_WAITING_MAX: usize = 64;

/// Trace events kept for the owner to take, at most (more are counted and
/// dropped).
pub const TRACE_EVENTS_MAX: usize = 256;

/// What a traced transfer did, for the owner's log and spans: a block
/// sent under an engine's trace id ([`Outgoing::trace`]) carries the id to
/// the peer (a `Trace` frame before its data, on connections whose peer
/// took [`FEATURE_TRACE`]), which times its landing and answers with that
/// time (a `Traced` frame before the ack).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TraceEvent {
    /// A traced block landing here ended.
    Landed {
        /// The sender's trace id.
        trace: u64,
        /// The sender's address, where its connection is still open.
        from: Option<SocketAddr>,
        /// Where it landed (or was to).
        target: BlockAddr,
        /// Its bytes.
        bytes: u64,
        /// The verdict acked; none: given back at its deadline, not whole.
        status: Option<AckStatus>,
        /// From its reservation or first slice here to its verdict, µs.
        us: u32,
    },
    /// A traced block this end sent was answered.
    Answered {
        /// Its trace id.
        trace: u64,
        /// Its transfer.
        transfer: u64,
        /// The peer's time on it, µs (0: the peer does not time traced
        /// blocks — a build before them — or the answer came on a
        /// connection that did not take them).
        peer_us: u32,
    },
}

/// Which negotiation an outbound connection's next answer is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Offered {
    /// Its features offer ([`Features`]).
    Features,
    /// The owner's offer of another transport.
    Owner,
}

/// One inbound connection, as the owner answers an offer made on it (a
/// closed and reused connection is another).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct InboundLink {
    token: usize,
    serial: u64,
}

/// A negotiation of another transport for a link (RDMA over TCP), for the
/// transport's owner: TCP carries the bytes, authenticated like any frame,
/// and does not read them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Negotiation {
    /// A peer writing to this node offers its half on an inbound link:
    /// answer with [`TcpTransport::answer_transport`].
    Offered {
        /// The link to answer on.
        from: InboundLink,
        /// The peer's address.
        address: Option<SocketAddr>,
        /// Its half.
        bytes: Vec<u8>,
    },
    /// The peer this node writes to answered this node's offer: its half,
    /// or none (declined: the link stays on TCP).
    Answered {
        /// The peer.
        peer: PeerId,
        /// Its half, if it accepted.
        bytes: Option<Vec<u8>>,
    },
}

pub use super::{Outgoing, PeerId};

/// A frame waiting to go out on a connection: its prefix (header, and its
/// tags on an authenticated connection), then `len` bytes at `bytes`
/// (none for an ack), `sent` of the two so far.
struct QueuedFrame {
    /// The transfer a data frame belongs to (acks: none).
    transfer: Option<u64>,
    header: [u8; SEALED_PREFIX_BYTES],
    /// Bytes of `header` sent: [`FRAME_HEADER_BYTES`], or
    /// [`SEALED_PREFIX_BYTES`] once sealed.
    prefix: usize,
    /// Its tags are made (its place in the connection's sequence taken):
    /// it must go out, even if its transfer ends first.
    sealed: bool,
    /// Its tags, being made on the tag threads (sealed, not ready yet).
    later: Option<Later<[u8; TAGS_BYTES]>>,
    bytes: *const u8,
    len: usize,
    sent: usize,
}

impl QueuedFrame {
    fn new(
        transfer: Option<u64>,
        header: [u8; FRAME_HEADER_BYTES],
        bytes: *const u8,
        len: usize,
        prefix: usize,
    ) -> Self {
        let mut full = [0u8; SEALED_PREFIX_BYTES];
        full[..FRAME_HEADER_BYTES].copy_from_slice(&header);
        Self { transfer, header: full, prefix, sealed: false, later: None, bytes, len, sent: 0 }
    }

    fn total(&self) -> usize {
        self.prefix + self.len
    }

    /// Whether it may go out: sealed with its tags in place (or on a
    /// plain link).
    fn ready(&mut self, authenticated: bool) -> bool {
        if !authenticated {
            return true;
        }
        if let Some(tags) = self.later.as_ref().and_then(Later::get) {
            self.header[FRAME_HEADER_BYTES..].copy_from_slice(&tags);
            self.later = None;
        }
        self.sealed && self.later.is_none()
    }
}

/// Where a connection's authentication stands.
enum Link {
    /// No link key: frames go bare.
    Plain,
    /// Outbound: hello sent, waiting for the answer.
    Client(Option<ClientHandshake>),
    /// Inbound: waiting for the hello.
    Server,
    /// Inbound: answered, waiting for the finish.
    Answered(Option<ServerHandshake>),
    /// Authenticated.
    Ready(Session),
}

/// What a connection is reading.
#[derive(Clone, Copy, Debug)]
enum ReadState {
    /// The next frame header.
    Header,
    /// A slice's bytes, into its target (`at`, `left` to go), for the
    /// landing keyed `key`; the slice is the `len` bytes from `start`.
    Slice { key: BlockAddr, attempt: u32, at: *mut u8, left: usize, start: *mut u8, len: usize },
    /// A refused slice's bytes, read and dropped.
    Discard { left: usize },
    /// A negotiation frame's `len` bytes, read whole from the buffer.
    Negotiation { kind: FrameKind, len: usize },
}

struct Stream {
    socket: TcpStream,
    /// Outbound: the peer it serves and its index among the peer's.
    peer: Option<(PeerId, usize)>,
    /// The TCP connection is up.
    up: bool,
    /// Frames may go: up, and authenticated where a key is set.
    connected: bool,
    link: Link,
    /// Handshake bytes to write before any frame, and how many went.
    handshake_out: Vec<u8>,
    handshake_sent: usize,
    /// What the slice being read must hash to (authenticated links).
    payload_check: Option<PayloadCheck>,
    readable: bool,
    writable: bool,
    queue: std::collections::VecDeque<QueuedFrame>,
    queued_bytes: usize,
    buffer: Box<[u8]>,
    /// Bytes of `buffer` read, and parsed.
    filled: usize,
    /// The last slice was large (read mostly straight into its target).
    large_slices: bool,
    /// Bytes the kernel held unacknowledged when last asked, and when.
    unsent: usize,
    unsent_at: u64,
    /// When bytes last moved on it (or it was made).
    progress_ns: u64,
    parsed: usize,
    state: ReadState,
    /// Which connection this is (a reused token is another).
    serial: u64,
    /// Bytes of the negotiation frames queued on it, kept while it lives.
    owned: Vec<Box<[u8]>>,
    /// Negotiation frames it brought.
    negotiations_in: usize,
    /// What both ends speak beyond the frames every build reads
    /// ([`Features`]): 0 until agreed.
    features: u64,
    /// Outbound: the offers made on it, oldest first, answered in order.
    offers: std::collections::VecDeque<Offered>,
    /// Inbound: the trace id named for the data frame that follows
    /// (its target, transfer, id).
    trace_next: Option<(BlockAddr, u64, u64)>,
}

impl Stream {
    fn new(socket: TcpStream, peer: Option<(PeerId, usize)>, up: bool, link: Link, now_ns: u64) -> Self {
        Self {
            progress_ns: now_ns,
            socket,
            peer,
            up,
            connected: up && matches!(link, Link::Plain),
            link,
            handshake_out: Vec::new(),
            handshake_sent: 0,
            payload_check: None,
            readable: false,
            writable: false,
            queue: std::collections::VecDeque::with_capacity(256),
            queued_bytes: 0,
            buffer: vec![0u8; RECV_BUFFER_BYTES].into_boxed_slice(),
            filled: 0,
            large_slices: false,
            unsent: 0,
            unsent_at: 0,
            parsed: 0,
            state: ReadState::Header,
            serial: 0,
            owned: Vec::new(),
            negotiations_in: 0,
            features: 0,
            offers: std::collections::VecDeque::new(),
            trace_next: None,
        }
    }

    /// Bytes written to the socket that the peer has not acknowledged
    /// (`SIOCOUTQ`), asked at most every 200 µs.
    fn kernel_unsent(&mut self, now_ns: u64) -> usize {
        use std::os::fd::AsRawFd;
        if now_ns.saturating_sub(self.unsent_at) > 200_000 || self.unsent_at == 0 {
            let mut unsent: libc::c_int = 0;
            // SAFETY: a valid socket and an int-sized out value.
            if unsafe { libc::ioctl(self.socket.as_raw_fd(), libc::TIOCOUTQ, &raw mut unsent) } == 0 {
                let unsent = usize::try_from(unsent).unwrap_or(0);
                // The peer's kernel acknowledged some: the path moves.
                if unsent < self.unsent {
                    self.progress_ns = now_ns;
                }
                self.unsent = unsent;
            }

            self.unsent_at = now_ns.max(1);
        }
        self.unsent
    }

    fn push(&mut self, frame: QueuedFrame) {
        self.queued_bytes += frame.total() - frame.sent;
        self.queue.push_back(frame);
    }

    /// Bytes before a frame's slice on this connection.
    fn prefix(&self) -> usize {
        if matches!(self.link, Link::Plain) { FRAME_HEADER_BYTES } else { SEALED_PREFIX_BYTES }
    }

    /// Whether it has bytes to write and may write them now.
    fn wants_write(&self) -> bool {
        self.up && self.writable && (self.handshake_pending() || (self.connected && !self.queue.is_empty()))
    }

    /// Handshake bytes still to write.
    fn handshake_pending(&self) -> bool {
        self.handshake_sent < self.handshake_out.len()
    }

    /// Whether the handshake is under way (a key is set, not yet done).
    fn handshaking(&self) -> bool {
        matches!(self.link, Link::Client(_) | Link::Server | Link::Answered(_))
    }
}

/// One path to a peer: its address there and, optionally, the local
/// address (interface) to leave from — one rail of a multi-NIC node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rail {
    /// The peer's address on this rail.
    pub remote: SocketAddr,
    /// The local address to bind to (`None`: the kernel's choice).
    pub local: Option<std::net::IpAddr>,
}

impl Rail {
    /// A rail to `remote`, leaving from wherever the kernel routes it.
    pub fn to(remote: SocketAddr) -> Self {
        Self { remote, local: None }
    }

    /// A rail as an operator writes it: `IP:PORT` (the peer's address on
    /// that network, leaving by the kernel's route) or `LOCAL>IP:PORT`
    /// (leaving from local address `LOCAL`: one NIC).
    pub fn parse(text: &str) -> Result<Self, String> {
        let (local, remote) = match text.split_once('>') {
            Some((local, remote)) => {
                (Some(local.parse().map_err(|e| format!("local address {local:?}: {e}"))?), remote)
            }
            None => (None, text),
        };
        let remote = remote.parse().map_err(|e| format!("address {remote:?}: {e}"))?;
        Ok(Self { remote, local })
    }

    /// Rails separated by commas (one peer reached over several NICs).
    pub fn parse_list(text: &str) -> Result<Vec<Self>, String> {
        let rails = text.split(',').map(Self::parse).collect::<Result<Vec<_>, _>>()?;
        if rails.len() > STREAMS_PER_PEER_MAX {
            return Err(format!("{} rails: at most {STREAMS_PER_PEER_MAX}", rails.len()));
        }
        Ok(rails)
    }
}

impl core::fmt::Display for Rail {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self.local {
            Some(local) => write!(f, "{local}>{}", self.remote),
            None => write!(f, "{}", self.remote),
        }
    }
}

/// A rail's state at one peer.
struct RailState {
    rail: Rail,
    /// No new slices before this (it broke lately), and the next wait.
    cooldown_until: u64,
    cooldown_ns: u64,
    /// Bytes written on it.
    bytes: u64,
    /// Times it was set aside after a connection on it broke.
    breaks: u64,
}

/// What one rail to a peer carried (for accounting and metrics).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RailReport {
    /// The rail as configured.
    pub rail: Rail,
    /// Bytes written on it.
    pub bytes: u64,
    /// Times it was set aside after a connection on it broke.
    pub breaks: u64,
    /// Whether it takes new slices now (not cooling down after a break).
    pub up: bool,
}

/// A slice waiting for a connection with room.
#[derive(Clone, Copy, Debug)]
struct PendingSlice {
    transfer: u64,
    attempt: u32,
    offset: u64,
    /// 0: the request for a slot (a block sent to [`ANY_SLOT`]).
    len: u64,
}

/// Slices a connection is given at a time at most (with what its kernel
/// queue still holds, over several rails) — or [`FEED_BYTES_MIN`] of small
/// ones: enough for many frames a `writev`, few enough that a slow rail
/// does not hoard slices a fast one could send.
const FEED_SLICES: usize = 2;

/// See [`FEED_SLICES`].
const FEED_BYTES_MIN: usize = 1 << 20;

/// A rail that broke is passed over this long at first (doubling while it
/// keeps breaking, to 64 times; back to this once a block is acked on it).
const RAIL_COOLDOWN_NS: u64 = 200_000_000;

/// A peer's connections: `streams_per_peer` on each rail, rail after rail.
struct Peer {
    rails: Vec<RailState>,
    /// Token of each connection, `None` while it is down.
    streams: Vec<Option<usize>>,
    /// Slices not yet given to a connection, per class, oldest first.
    pending: [std::collections::VecDeque<PendingSlice>; Priority::COUNT],
    /// When each down connection may be tried again, and the next wait.
    retry_at: Vec<(u64, u64)>,
    /// Why its last connection broke (for a transfer that fails with none
    /// up: "another link key" says more than "no connection").
    last_break: Option<String>,
    /// The link version its handshakes offer: this node's latest, until
    /// the peer says it speaks only an older one.
    link_version: u8,
}

/// A transfer this end sent, until its ack.
struct Sending {
    block: Outgoing,
    deadline_ns: u64,
    /// Which sending of it this is.
    attempt: u32,
    /// Which of the peer's connections carry a slice of this attempt (0:
    /// waiting for one to come up).
    streams: u64,
    /// Some of its bytes were written (it can no longer be cancelled).
    wrote: bool,
    /// The peer's time on it, from its `Traced` frame (0: none).
    peer_us: u32,
}

/// Sendings of one transfer beyond one per connection of its peer: a
/// transfer whose connection broke is sent again, whole, over the peer's
/// other connections (or the next to come up), this many times more than
/// the peer has connections — each may have died unnoticed at once.
const EXTRA_ATTEMPTS: u32 = 2;

/// A block landing here, until it is whole. A connection that brought
/// some of it may break: the sender then sends it again (a later attempt)
/// over another, or the deadline gives the slot back.
struct Arriving {
    transfer: u64,
    attempt: u32,
    base: *mut u8,
    total: u64,
    received: u64,
    /// Of `received`, bytes whose payload tag is being checked on the tag
    /// threads: the block is whole only once none are.
    unverified: u64,
    /// Times its count was reset within one attempt (a slice that failed
    /// its tag): a verdict for an earlier count is dropped.
    resets: u32,
    deadline_ns: u64,
    /// The sender's trace id (0: untraced), and when it started landing.
    trace: u64,
    started_ns: u64,
}

/// A slice's payload tag being checked on the tag threads, its bytes in
/// the target.
struct Checking {
    token: usize,
    serial: u64,
    key: BlockAddr,
    attempt: u32,
    resets: u32,
    len: u64,
    verdict: Later<bool>,
}

/// What the transport has done.
#[derive(Clone, Copy, Debug, Default)]
pub struct TcpStats {
    /// Blocks sent and acknowledged landed.
    pub sent: u64,
    /// Bytes of those.
    pub bytes_sent: u64,
    /// Blocks that landed here.
    pub landed: u64,
    /// Bytes of those.
    pub bytes_landed: u64,
    /// Transfers failed (any reason).
    pub failed: u64,
    /// Connections lost.
    pub streams_lost: u64,
    /// Transfers sent again after a connection broke.
    pub retried: u64,
    /// Times a rail was set aside after a connection on it broke.
    pub rail_cooldowns: u64,
    /// Frames refused as malformed (their connection was closed).
    pub bad_frames: u64,
    /// Connections authenticated (handshakes completed, either side).
    pub handshakes: u64,
    /// Handshakes refused: no handshake, another key, a bad proof, no
    /// answer in time (the connection was closed).
    pub handshakes_refused: u64,
    /// Frames whose tags failed: tampered, replayed, reordered (the
    /// connection was closed; a slice's block given back unpublished).
    pub bad_tags: u64,
    /// Security events dropped because the caller did not take them.
    pub security_events_dropped: u64,
    /// Frames whose tags were made on the tag threads while the link went
    /// on ([`TcpConfig::tags_later`]).
    pub sealed_later: u64,
    /// Slices whose payload tag was checked on the tag threads.
    pub checked_later: u64,
    /// Trace events dropped because the owner did not take them.
    pub trace_events_dropped: u64,
    /// `writev` / read calls.
    pub write_calls: u64,
    /// Read calls.
    pub read_calls: u64,
    /// Reservations this end answered `Later`: their tenant was at its cap
    /// on what this node receives.
    pub reservations_held: u64,
    /// Reservations peers answered `Later`, asked again after the wait.
    pub reservations_later: u64,
}

/// The shortest wait between a reservation answered `Later` and the next
/// ask, µs.
const LATER_US_MIN: u64 = 200;

/// Why the transport could not start or take a write.
#[derive(Debug)]
pub struct TcpError(pub String);

impl core::fmt::Display for TcpError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TcpError {}

const LISTENER: Token = Token(usize::MAX);

/// The TCP transport of one node.
pub struct TcpTransport {
    config: TcpConfig,
    poll: Poll,
    events: Events,
    listener: Option<TcpListener>,
    streams: Vec<Option<Stream>>,
    peers: Vec<Peer>,
    sending: HashMap<u64, Sending>,
    landing: HashMap<BlockAddr, Arriving>,
    /// Blocks landed lately: (transfer, attempt acked, when). A later
    /// attempt of the same transfer (its sender did not hear the ack) is
    /// answered `Landed` again, its bytes dropped.
    landed: HashMap<BlockAddr, (u64, u32, u64)>,
    /// Reservations the peer answered `Later` (its receive cap for the
    /// block's tenant): transfer, attempt, when to ask again.
    later: Vec<(u64, u32, u64)>,
    done: Vec<Completion>,
    /// Tokens touched by the last events (reused).
    touched: Vec<usize>,
    last_sweep_ns: u64,
    /// The time the current poll was given.
    now_ns: u64,
    /// The link key and this node's id, where links are authenticated.
    auth: Option<(LinkKey, u64)>,
    /// What was refused and why, for the caller's log.
    security_events: std::collections::VecDeque<String>,
    /// The latest link version this end speaks (its handshakes offer it and
    /// answer up to it).
    link_version: u8,
    /// Offers of another transport are passed to the owner (else each is
    /// declined at once).
    negotiates: bool,
    negotiations: Vec<Negotiation>,
    /// The serial of the next connection made.
    next_serial: u64,
    /// Slices' payload tags being checked on the tag threads.
    checking: Vec<Checking>,
    /// What traced transfers did, for the owner ([`TRACE_EVENTS_MAX`]).
    trace_events: Vec<TraceEvent>,
    /// Added to every transfer id this end puts on the wire (and taken
    /// off the answers): a receiver keys what lands by transfer id, and
    /// two senders' callers may both number theirs from 1. Random per
    /// transport, so ids of different senders do not meet.
    wire_salt: u64,
    /// What it has done.
    pub stats: TcpStats,
}

// SAFETY: the raw addresses it holds are of memory its caller keeps valid
// until the transfer's completion (`write`'s contract) or of slots its
// `Landing` placed; a process's memory is the same from any thread, so the
// transport may move to (and be driven from) another thread. It is never
// shared: every method takes it by `&mut`.
unsafe impl Send for TcpTransport {}

impl core::fmt::Debug for TcpTransport {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("TcpTransport").field("stats", &self.stats).finish_non_exhaustive()
    }
}

fn io_error(what: &str) -> impl Fn(std::io::Error) -> TcpError + '_ {
    move |e| TcpError(format!("{what}: {e}"))
}

impl TcpTransport {
    /// A transport; listening on `listen` if given (port 0: any).
    pub fn new(config: TcpConfig, listen: Option<SocketAddr>) -> Result<Self, TcpError> {
        if config.streams_per_peer == 0 || config.streams_per_peer > STREAMS_PER_PEER_MAX {
            return Err(TcpError(format!("streams_per_peer is 1..={STREAMS_PER_PEER_MAX}")));
        }
        if config.slice_bytes == 0 || config.slice_bytes > super::frame::SLICE_BYTES_MAX {
            return Err(TcpError(format!("slice_bytes is 1..={}", super::frame::SLICE_BYTES_MAX)));
        }
        let poll = Poll::new().map_err(io_error("creating the poll"))?;
        let listener = match listen {
            None => None,
            Some(address) => {
                let mut listener = TcpListener::bind(address).map_err(io_error("listening"))?;
                poll.registry()
                    .register(&mut listener, LISTENER, Interest::READABLE)
                    .map_err(io_error("registering the listener"))?;
                Some(listener)
            }
        };
        Ok(Self {
            config,
            poll,
            events: Events::with_capacity(256),
            listener,
            streams: Vec::new(),
            peers: Vec::new(),
            sending: HashMap::with_capacity(config.in_flight_max),
            landing: HashMap::with_capacity(config.landing_max),
            landed: HashMap::with_capacity(config.landing_max),
            later: Vec::with_capacity(config.in_flight_max),
            done: Vec::with_capacity(config.in_flight_max),
            touched: Vec::with_capacity(256),
            last_sweep_ns: 0,
            now_ns: 0,
            auth: None,
            security_events: std::collections::VecDeque::new(),
            link_version: crate::auth::handshake::AUTH_VERSION,
            negotiates: false,
            negotiations: Vec::new(),
            next_serial: 1,
            checking: Vec::new(),
            trace_events: Vec::with_capacity(TRACE_EVENTS_MAX),
            wire_salt: random_u64(),
            stats: TcpStats::default(),
        })
    }

    /// Authenticates every connection with `key` from now on (this node
    /// named `node` in handshakes): a peer without the key gets no frame
    /// through. Set before any peer is added.
    pub fn authenticate(&mut self, key: LinkKey, node: u64) -> Result<(), TcpError> {
        if self.streams.iter().any(Option::is_some) {
            return Err(TcpError("authenticate before adding peers or accepting connections".into()));
        }
        self.auth = Some((key, node));
        Ok(())
    }

    /// Speaks link versions up to `latest` only (from
    /// [`crate::auth::handshake::AUTH_VERSION_MIN`]): a node held at its
    /// peers' older version (how a test runs one a release behind). Set
    /// before any peer is added.
    pub fn speak_link_versions_up_to(&mut self, latest: u8) -> Result<(), TcpError> {
        if !crate::auth::handshake::speaks(latest) {
            return Err(TcpError(format!(
                "link version {latest}: this build speaks {} to {}",
                crate::auth::handshake::AUTH_VERSION_MIN,
                crate::auth::handshake::AUTH_VERSION
            )));
        }
        if !self.peers.is_empty() {
            return Err(TcpError("set the link version before adding peers".into()));
        }
        self.link_version = latest;
        Ok(())
    }

    /// The link version each authenticated connection to `peer` offers
    /// (this node's latest, or the older one the peer said it speaks).
    pub fn link_version(&self, peer: PeerId) -> Option<u8> {
        self.peers.get(peer.0 as usize).map(|p| p.link_version)
    }

    /// Whether links are authenticated.
    pub fn is_authenticated(&self) -> bool {
        self.auth.is_some()
    }

    /// What was refused since the last call (a handshake, a frame's tag),
    /// one line each, oldest first: for the node's log.
    pub fn take_security_events(&mut self) -> Vec<String> {
        self.security_events.drain(..).collect()
    }

    fn security_event(&mut self, token: usize, what: &str) {
        let from = self.streams[token]
            .as_ref()
            .and_then(|s| s.socket.peer_addr().ok())
            .map_or_else(|| "an unknown address".to_string(), |a| a.to_string());
        self.note(format!("connection with {from}: {what}"));
    }

    /// Keeps `line` for the caller's log, the oldest dropped (counted)
    /// past [`SECURITY_EVENTS_MAX`].
    fn note(&mut self, line: String) {
        if self.security_events.len() >= SECURITY_EVENTS_MAX {
            self.security_events.pop_front();
            self.stats.security_events_dropped += 1;
        }
        self.security_events.push_back(line);
    }

    /// Where it listens.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// The descriptor to wait on (readable when there is work) for a
    /// caller that parks.
    pub fn raw_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.poll.as_raw_fd()
    }

    /// A peer at `address`: its connections are opened (non-blocking) now.
    pub fn add_peer(&mut self, address: SocketAddr) -> Result<PeerId, TcpError> {
        self.add_peer_rails(&[Rail::to(address)])
    }

    /// A peer reached over several rails (NICs): `streams_per_peer`
    /// connections on each; slices go to the connections that drain
    /// fastest, away from rails that broke lately.
    pub fn add_peer_rails(&mut self, rails: &[Rail]) -> Result<PeerId, TcpError> {
        let id = PeerId(u32::try_from(self.peers.len()).map_err(|_| TcpError("too many peers".into()))?);
        let streams = self.config.streams_per_peer * rails.len();
        if rails.is_empty() || streams > STREAMS_PER_PEER_MAX {
            return Err(TcpError(format!(
                "a peer has 1 or more rails and at most {STREAMS_PER_PEER_MAX} connections in all"
            )));
        }
        self.peers.push(Peer {
            rails: rails
                .iter()
                .map(|&rail| RailState { rail, cooldown_until: 0, cooldown_ns: RAIL_COOLDOWN_NS, bytes: 0, breaks: 0 })
                .collect(),
            streams: vec![None; streams],
            pending: core::array::from_fn(|_| std::collections::VecDeque::with_capacity(256)),
            retry_at: vec![(0, self.config.reconnect_ns); streams],
            last_break: None,
            link_version: self.link_version,
        });
        for index in 0..streams {
            self.connect(id, index)?;
        }
        Ok(id)
    }

    /// Connections to `peer` that are up.
    pub fn connected(&self, peer: PeerId) -> usize {
        self.peers.get(peer.0 as usize).map_or(0, |p| {
            p.streams.iter().flatten().filter(|&&t| self.streams[t].as_ref().is_some_and(|s| s.connected)).count()
        })
    }

    /// Bytes written to `peer` on each of its rails.
    pub fn rail_bytes(&self, peer: PeerId) -> Vec<u64> {
        self.rail_reports(peer).iter().map(|r| r.bytes).collect()
    }

    /// Each of `peer`'s rails, in configured order: what it carried and
    /// whether it is in use now.
    pub fn rail_reports(&self, peer: PeerId) -> Vec<RailReport> {
        self.peers.get(peer.0 as usize).map_or_else(Vec::new, |p| {
            p.rails
                .iter()
                .map(|r| RailReport {
                    rail: r.rail,
                    bytes: r.bytes,
                    breaks: r.breaks,
                    up: r.cooldown_until <= self.now_ns,
                })
                .collect()
        })
    }

    fn connect(&mut self, peer: PeerId, index: usize) -> Result<(), TcpError> {
        let rail = self.peers[peer.0 as usize].rails[index / self.config.streams_per_peer].rail;
        let mut socket = match rail.local {
            None => TcpStream::connect(rail.remote).map_err(io_error("connecting"))?,
            Some(local) => connect_from(local, rail.remote).map_err(io_error("connecting from a rail's address"))?,
        };
        let _ = socket.set_nodelay(true);
        let token = self.free_token();
        self.poll
            .registry()
            .register(&mut socket, Token(token), Interest::READABLE | Interest::WRITABLE)
            .map_err(io_error("registering a connection"))?;
        let link = if self.auth.is_some() { Link::Client(None) } else { Link::Plain };
        let mut stream = Stream::new(socket, Some((peer, index)), false, link, self.now_ns);
        stream.serial = self.next_serial;
        self.next_serial += 1;
        self.streams[token] = Some(stream);
        self.peers[peer.0 as usize].streams[index] = Some(token);
        Ok(())
    }

    fn free_token(&mut self) -> usize {
        if let Some(free) = self.streams.iter().position(Option::is_none) {
            return free;
        }
        self.streams.push(None);
        self.streams.len() - 1
    }

    /// Queues `block` for its peer: split into slices over the peer's
    /// connections that are up. Completes (once) through [`poll`].
    ///
    /// # Safety
    ///
    /// `block.source` is valid for `block.len` bytes, unchanged, until the
    /// transfer's completion has been returned by [`poll`].
    ///
    /// [`poll`]: TcpTransport::poll
    pub unsafe fn write(&mut self, block: &Outgoing, now_ns: u64) -> Result<(), TransferError> {
        if block.len == 0 || block.len > super::frame::OBJECT_BYTES_MAX {
            return Err(TransferError::Invalid("length"));
        }
        if self.sending.len() >= self.config.in_flight_max {
            return Err(TransferError::Busy);
        }
        if self.sending.contains_key(&block.transfer) {
            return Err(TransferError::Invalid("transfer id in flight"));
        }
        if self.peers.get(block.peer.0 as usize).is_none() {
            return Err(TransferError::Invalid("peer"));
        }
        let mut sending = Sending {
            block: *block,
            deadline_ns: now_ns + self.config.transfer_timeout_ns,
            attempt: 0,
            streams: 0,
            wrote: false,
            peer_us: 0,
        };
        // No connection up (yet, or again): it waits for one, or its deadline.
        self.queue_slices(&mut sending, false)?;
        self.sending.insert(block.transfer, sending);
        self.feed(block.peer);
        Ok(())
    }

    /// Queues the slices of `sending` (its current attempt) over its peer's
    /// connections that are up, the least loaded first.
    /// Cuts `sending` (its current attempt) into slices waiting for a
    /// connection: behind what waits already, or — a transfer sent again —
    /// ahead of it (it is the oldest, nearest its deadline).
    fn queue_slices(&mut self, sending: &mut Sending, first: bool) -> Result<(), TransferError> {
        let block = sending.block;
        let peer = self.peers.get_mut(block.peer.0 as usize).ok_or(TransferError::Invalid("peer"))?;
        sending.streams = 0;
        if block.target.slot == ANY_SLOT {
            // No slot yet: ask for one first (a slice of no bytes).
            let ask = PendingSlice { transfer: block.transfer, attempt: sending.attempt, offset: 0, len: 0 };
            let queue = &mut peer.pending[block.priority as usize];
            if first {
                queue.push_front(ask);
            } else {
                queue.push_back(ask);
            }
            return Ok(());
        }
        let slice = u64::from(self.config.slice_bytes);
        let count = block.len.div_ceil(slice);
        for k in 0..count {
            // Ahead: pushed last slice first, so they keep their order.
            let k = if first { count - 1 - k } else { k };
            let offset = k * slice;
            let len = slice.min(block.len - offset);
            let pending = PendingSlice { transfer: block.transfer, attempt: sending.attempt, offset, len };
            let queue = &mut peer.pending[block.priority as usize];
            if first {
                queue.push_front(pending);
            } else {
                queue.push_back(pending);
            }
        }
        Ok(())
    }

    /// Hands `peer`'s pending slices, oldest first, to its connections that
    /// have room ([`FEED_SLICES`] queued at most), the least loaded first,
    /// on rails that did not break lately (any rail, when every one did).
    /// A connection that drains faster comes back for more sooner: the
    /// slices spread by each rail's measured speed.
    fn feed(&mut self, peer: PeerId) {
        let per_rail = self.config.streams_per_peer;
        let salt = self.wire_salt;
        let bound = (FEED_SLICES * (self.config.slice_bytes as usize + FRAME_HEADER_BYTES)).max(FEED_BYTES_MIN);
        let Some(p) = self.peers.get_mut(peer.0 as usize) else { return };
        loop {
            // The most urgent class first.
            let Some(class) = p.pending.iter().position(|q| !q.is_empty()) else { return };
            let Some(&next) = p.pending[class].front() else { return };
            // A slice of a transfer that ended or was sent again since.
            let Some(sending) = self.sending.get_mut(&next.transfer).filter(|s| s.attempt == next.attempt) else {
                p.pending[class].pop_front();
                continue;
            };
            let mut best: Option<(usize, usize, usize)> = None;
            // Over several rails, what the kernel still holds counts too:
            // its send buffers would otherwise hide a slow rail.
            let rails = p.rails.len() > 1;
            // A traced block takes a connection whose features are settled
            // first (its trace id then goes with it), any if none has room.
            let traced = sending.block.trace != 0;
            let passes: &[(bool, bool)] =
                if traced { &[(true, true), (true, false), (false, false)] } else { &[(true, false), (false, false)] };
            for &(healthy_only, settled_only) in passes {
                for (index, token) in p.streams.iter().enumerate() {
                    let cooling = p.rails[index / per_rail].cooldown_until > self.now_ns;
                    let Some(token) = *token else { continue };
                    let Some(stream) = self.streams[token].as_mut().filter(|s| s.connected) else { continue };
                    let load = stream.queued_bytes + if rails { stream.kernel_unsent(self.now_ns) } else { 0 };
                    let unsettled = stream.offers.contains(&Offered::Features);
                    if (healthy_only && cooling) || (settled_only && unsettled) || load >= bound {
                        continue;
                    }
                    if best.is_none_or(|(_, _, least)| load < least) {
                        best = Some((index, token, load));
                    }
                }
                if best.is_some() {
                    break;
                }
            }
            let Some((index, token, _)) = best else { return };
            p.pending[class].pop_front();
            let block = sending.block;
            sending.streams |= 1 << index;
            let slice_len = u32::try_from(next.len).unwrap_or(self.config.slice_bytes);
            let header = if next.len == 0 {
                let (region, epoch) = (block.target.region, block.target.epoch);
                let reserve =
                    FrameHeader::reserve((block.transfer.wrapping_add(salt), next.attempt), region, epoch, block.len);
                // The receiver may hold the block's tenant to a cap.
                let tenants = self.streams[token].as_ref().is_some_and(|s| s.features & FEATURE_TENANT != 0);
                if tenants { reserve.for_namespace(block.namespace) } else { reserve }
            } else {
                let transfer = block.transfer.wrapping_add(salt);
                FrameHeader::data((transfer, next.attempt), block.target, block.len, next.offset, slice_len)
            }
            .with_priority(block.priority)
            .encode();
            if let Some(stream) = self.streams[token].as_mut() {
                let prefix = stream.prefix();
                if block.trace != 0 && next.len > 0 && stream.features & FEATURE_TRACE != 0 {
                    // The trace id, for the data frame right behind it.
                    let wire = (block.transfer.wrapping_add(salt), next.attempt);
                    let trace = FrameHeader::trace(wire, block.target, block.len, block.trace)
                        .with_priority(block.priority)
                        .encode();
                    stream.push(QueuedFrame::new(Some(block.transfer), trace, core::ptr::null(), 0, prefix));
                }
                let source = block.source.wrapping_add(bytes(next.offset));
                stream.push(QueuedFrame::new(Some(block.transfer), header, source, bytes(next.len), prefix));
                // Its tags are begun now, while earlier frames go out.
                self.stats.sealed_later += seal_ahead(stream, self.config.tags_later);
            }
        }
    }

    /// Transfers waiting for their ack.
    pub fn in_flight(&self) -> usize {
        self.sending.len()
    }

    /// Moves bytes: accepts, connects, reads and lands, writes and acks,
    /// fails what broke or timed out. Completions of this end's writes go
    /// to `out`; returns whether anything happened.
    pub fn poll(&mut self, landing: &mut dyn Landing, now_ns: u64, out: &mut Vec<Completion>) -> bool {
        self.poll_wait(landing, now_ns, out, std::time::Duration::ZERO)
    }

    /// [`TcpTransport::poll`], but when nothing is left to do without a new
    /// event, the calling thread sleeps for one, up to `wait` (a caller with
    /// nothing else to drive parks here instead of spinning).
    pub fn poll_wait(
        &mut self,
        landing: &mut dyn Landing,
        now_ns: u64,
        out: &mut Vec<Completion>,
        wait: std::time::Duration,
    ) -> bool {
        let mut busy = false;
        self.now_ns = now_ns;
        let ready = self.streams.iter().flatten().any(|s| s.readable || s.wants_write());
        // Slices waiting for a kernel queue to drain: no event says when,
        // so look again soon.
        let waiting = !self.later.is_empty() || self.peers.iter().any(|p| p.pending.iter().any(|q| !q.is_empty()));
        let timeout = if ready || !self.done.is_empty() || !self.checking.is_empty() {
            std::time::Duration::ZERO
        } else if waiting {
            wait.min(std::time::Duration::from_micros(200))
        } else {
            wait
        };
        if self.poll.poll(&mut self.events, Some(timeout)).is_err() {
            return false;
        }
        // Events first noted (the event list borrows the poll's buffer),
        // then acted on.
        let mut accept = false;
        self.touched.clear();
        for event in &self.events {
            if event.token() == LISTENER {
                accept = true;
                continue;
            }
            let token = event.token().0;
            if let Some(stream) = self.streams.get_mut(token).and_then(Option::as_mut) {
                stream.readable |= event.is_readable() || event.is_read_closed() || event.is_error();
                stream.writable |= event.is_writable();
                if !stream.up && (event.is_writable() || event.is_error()) {
                    self.touched.push(token);
                }
            }
        }
        if accept {
            busy |= self.accept();
        }
        for i in 0..self.touched.len() {
            let token = self.touched[i];
            let Some(stream) = self.streams[token].as_mut() else { continue };
            let up = stream.socket.take_error().ok().flatten().is_none() && stream.socket.peer_addr().is_ok();
            if !up {
                self.lose(token, "connect failed");
                continue;
            }
            stream.up = true;
            stream.progress_ns = now_ns;
            match &self.auth {
                None => self.on_connected(token),
                Some((key, node)) => {
                    let Ok(nonce) = crate::auth::nonce() else {
                        self.lose(token, "no random nonce for the handshake");
                        continue;
                    };
                    let version = stream
                        .peer
                        .and_then(|(peer, _)| self.peers.get(peer.0 as usize))
                        .map_or(self.link_version, |p| p.link_version);
                    let (handshake, hello) = ClientHandshake::offering(key, *node, nonce, version);
                    stream.link = Link::Client(Some(handshake));
                    stream.handshake_out = hello.to_vec();
                    busy |= self.flush(token);
                }
            }
        }
        for token in 0..self.streams.len() {
            let Some(stream) = self.streams[token].as_ref() else { continue };
            if stream.readable {
                busy |= self.read(token, landing, now_ns);
            }
            let Some(stream) = self.streams[token].as_ref() else { continue };
            if stream.wants_write() {
                busy |= self.flush(token);
            }
        }
        if !self.checking.is_empty() {
            busy |= self.take_verdicts(landing);
        }
        // Slices waiting while the connections' kernel queues drain.
        for peer in 0..self.peers.len() {
            let waiting = |p: &Peer| p.pending.iter().map(std::collections::VecDeque::len).sum::<usize>();
            let before = waiting(&self.peers[peer]);
            if before > 0 {
                self.feed(PeerId(u32::try_from(peer).unwrap_or(u32::MAX)));
                busy |= waiting(&self.peers[peer]) != before;
            }
        }
        if now_ns.saturating_sub(self.last_sweep_ns) > 1_000_000 {
            self.last_sweep_ns = now_ns;
            self.sweep(landing, now_ns);
        }
        busy |= !self.done.is_empty();
        self.release_done(out);
        busy
    }

    /// Moves the completions that may go to `out`: a transfer with a frame
    /// still queued (one already tagged must go out whole even after its
    /// transfer ended) keeps its completion, so its source stays the
    /// caller's to keep, until the frame is written or its connection gone.
    fn release_done(&mut self, out: &mut Vec<Completion>) {
        let streams = &self.streams;
        let queued =
            |transfer: u64| streams.iter().flatten().any(|s| s.queue.iter().any(|f| f.transfer == Some(transfer)));
        if self.done.iter().all(|c| !queued(c.transfer)) {
            out.append(&mut self.done);
            return;
        }
        let mut held = Vec::new();
        for completion in self.done.drain(..) {
            if queued(completion.transfer) { held.push(completion) } else { out.push(completion) }
        }
        self.done = held;
    }

    /// A connection may carry frames (up, and authenticated where a key
    /// is set): an outbound one's next break waits the base time, and the
    /// transfers waiting for a connection go.
    fn on_connected(&mut self, token: usize) {
        let Some(stream) = self.streams[token].as_mut() else { return };
        stream.connected = true;
        let outbound = stream.peer.is_some();
        if outbound && self.config.features != 0 {
            // What this end speaks, first on the connection; until the
            // answer, it sends only what every build reads.
            let offer = Features(self.config.features).encode();
            if self.queue_negotiation(token, FrameHeader::negotiate(FEATURES_LEN), &offer).is_ok()
                && let Some(stream) = self.streams[token].as_mut()
            {
                stream.offers.push_back(Offered::Features);
            }
        }
        let Some(stream) = self.streams[token].as_mut() else { return };
        if let Some((peer, index)) = stream.peer {
            if let Some(p) = self.peers.get_mut(peer.0 as usize) {
                p.retry_at[index].1 = self.config.reconnect_ns;
            }
            self.feed(peer);
        }
    }

    fn accept(&mut self) -> bool {
        let mut accepted = false;
        loop {
            let Some(listener) = self.listener.as_ref() else { return accepted };
            match listener.accept() {
                Ok((mut socket, from)) => {
                    let _ = socket.set_nodelay(true);
                    let link = if self.auth.is_some() { Link::Server } else { Link::Plain };
                    if !matches!(link, Link::Plain)
                        && self.streams.iter().flatten().filter(|s| s.handshaking()).count() >= HANDSHAKING_MAX
                    {
                        self.stats.handshakes_refused += 1;
                        self.note(format!("connection with {from}: refused, {HANDSHAKING_MAX} handshakes under way"));
                        continue;
                    }
                    let token = self.free_token();
                    if self
                        .poll
                        .registry()
                        .register(&mut socket, Token(token), Interest::READABLE | Interest::WRITABLE)
                        .is_ok()
                    {
                        let mut stream = Stream::new(socket, None, true, link, self.now_ns);
                        stream.serial = self.next_serial;
                        self.next_serial += 1;
                        self.streams[token] = Some(stream);
                        accepted = true;
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return accepted,
                Err(_) => return accepted,
            }
        }
    }

    /// Reads what the connection has, frame by frame.
    fn read(&mut self, token: usize, landing: &mut dyn Landing, now_ns: u64) -> bool {
        let mut busy = false;
        loop {
            let Some(stream) = self.streams[token].as_mut() else { return busy };
            // Bytes already buffered first.
            match stream.state {
                ReadState::Header if stream.handshaking() => {
                    let need = match stream.link {
                        Link::Server => CLIENT_HELLO_BYTES,
                        Link::Client(_) => SERVER_HELLO_BYTES,
                        _ => CLIENT_FINISH_BYTES,
                    };
                    if stream.filled - stream.parsed >= need {
                        let mut message = [0u8; SERVER_HELLO_BYTES];
                        message[..need].copy_from_slice(&stream.buffer[stream.parsed..stream.parsed + need]);
                        stream.parsed += need;
                        busy = true;
                        if !self.on_handshake(token, &message[..need]) {
                            return true;
                        }
                        continue;
                    }
                }
                ReadState::Header => {
                    let prefix = stream.prefix();
                    if stream.filled - stream.parsed >= prefix {
                        let mut header = [0u8; FRAME_HEADER_BYTES];
                        header.copy_from_slice(&stream.buffer[stream.parsed..stream.parsed + FRAME_HEADER_BYTES]);
                        if let Link::Ready(session) = &mut stream.link {
                            let mut tags = [0u8; TAGS_BYTES];
                            tags.copy_from_slice(
                                &stream.buffer[stream.parsed + FRAME_HEADER_BYTES..stream.parsed + prefix],
                            );
                            match session.open_header(&header, &tags) {
                                Ok(check) => stream.payload_check = Some(check),
                                Err(e) => {
                                    self.refuse_frame(token, &e);
                                    return true;
                                }
                            }
                        }
                        stream.parsed += prefix;
                        busy = true;
                        match FrameHeader::decode(&header) {
                            Ok(frame) => {
                                let carries = matches!(
                                    frame.kind,
                                    FrameKind::Data | FrameKind::Negotiate | FrameKind::Negotiated
                                ) && frame.slice_len > 0;
                                // A frame with no bytes after it: its bytes' tag
                                // is checked now.
                                if !carries
                                    && let Some(check) = stream.payload_check.take()
                                    && let Err(e) = check.verify(&[])
                                {
                                    self.refuse_frame(token, &e);
                                    return true;
                                }
                                if carries && frame.kind != FrameKind::Data {
                                    stream.state =
                                        ReadState::Negotiation { kind: frame.kind, len: bytes(frame.total_len) };
                                    continue;
                                }
                                self.on_frame(token, &frame, landing, now_ns);
                            }
                            Err(e) => {
                                self.stats.bad_frames += 1;
                                self.lose(token, &bad_frame(e));
                                return true;
                            }
                        }
                        continue;
                    }
                }
                ReadState::Slice { key, attempt, at, left, .. } => {
                    let buffered = (stream.filled - stream.parsed).min(left);
                    if buffered > 0 {
                        let from = &stream.buffer[stream.parsed..stream.parsed + buffered];
                        // SAFETY: `at` points into the target `Landing`
                        // placed for this block, `left` >= `buffered` bytes
                        // of room; the buffer is this stream's own.
                        unsafe { core::ptr::copy_nonoverlapping(from.as_ptr(), at, buffered) };
                        stream.parsed += buffered;
                        busy = true;
                        self.advance(token, (key, attempt), at, left, buffered, landing);
                        continue;
                    }
                    if left >= DIRECT_READ_MIN {
                        // SAFETY: as above: `left` bytes of the target.
                        let target = unsafe { core::slice::from_raw_parts_mut(at, left) };
                        self.stats.read_calls += 1;
                        match stream.socket.read(target) {
                            Ok(0) => {
                                self.lose(token, "closed by the peer");
                                return true;
                            }
                            Ok(n) => {
                                busy = true;
                                stream.progress_ns = self.now_ns;
                                self.advance(token, (key, attempt), at, left, n, landing);
                                continue;
                            }
                            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                                stream.readable = false;
                                return busy;
                            }
                            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                            Err(e) => {
                                self.lose(token, &e.to_string());
                                return true;
                            }
                        }
                    }
                }
                ReadState::Negotiation { kind, len } => {
                    if stream.filled - stream.parsed >= len {
                        let mut message = [0u8; super::frame::NEGOTIATE_BYTES_MAX as usize];
                        message[..len].copy_from_slice(&stream.buffer[stream.parsed..stream.parsed + len]);
                        stream.parsed += len;
                        stream.state = ReadState::Header;
                        busy = true;
                        if let Some(check) = stream.payload_check.take()
                            && let Err(e) = check.verify(&message[..len])
                        {
                            self.refuse_frame(token, &e);
                            return true;
                        }
                        self.on_negotiation(token, kind, &message[..len]);
                        continue;
                    }
                }
                ReadState::Discard { left } => {
                    let buffered = (stream.filled - stream.parsed).min(left);
                    if buffered > 0 {
                        stream.parsed += buffered;
                        stream.state = if left == buffered {
                            ReadState::Header
                        } else {
                            ReadState::Discard { left: left - buffered }
                        };
                        busy = true;
                        continue;
                    }
                }
            }
            // Refill the buffer.
            if stream.parsed == stream.filled {
                stream.parsed = 0;
                stream.filled = 0;
            } else if stream.parsed > 0 && stream.filled == stream.buffer.len() {
                stream.buffer.copy_within(stream.parsed..stream.filled, 0);
                stream.filled -= stream.parsed;
                stream.parsed = 0;
            }
            self.stats.read_calls += 1;
            let filled = stream.filled;
            // After a large slice the next one is likely large too: read
            // little through the buffer, so its bytes go straight to their
            // target instead of being copied out of the buffer.
            let end = if stream.large_slices {
                (filled + SMALL_READ_BYTES).min(stream.buffer.len())
            } else {
                stream.buffer.len()
            };
            match stream.socket.read(&mut stream.buffer[filled..end]) {
                Ok(0) => {
                    self.lose(token, "closed by the peer");
                    return true;
                }
                Ok(n) => {
                    stream.filled += n;
                    stream.progress_ns = self.now_ns;
                    busy = true;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    stream.readable = false;
                    return busy;
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    self.lose(token, &e.to_string());
                    return true;
                }
            }
        }
    }

    /// `n` more bytes of a slice of attempt `attempt` arrived at `at`.
    fn advance(
        &mut self,
        token: usize,
        (key, attempt): (BlockAddr, u32),
        at: *mut u8,
        left: usize,
        n: usize,
        landing: &mut dyn Landing,
    ) {
        let Some(stream) = self.streams[token].as_mut() else { return };
        let (start, len) = match stream.state {
            ReadState::Slice { start, len, .. } => (start, len),
            _ => (at, n),
        };
        let mut checking = None;
        if n < left {
            stream.state = ReadState::Slice { key, attempt, at: at.wrapping_add(n), left: left - n, start, len };
        } else {
            stream.state = ReadState::Header;
            // The whole slice is in its target: its bytes count only if
            // they are the ones sealed.
            if let Some(check) = stream.payload_check.take() {
                let verdict = if self.config.tags_later {
                    // SAFETY: the slice's `len` bytes from `start` lie in
                    // the target placed for this block, every one written
                    // now; the slot is neither written again nor given back
                    // before the verdict is in (`settle_checks`).
                    unsafe { check.verify_later(start.cast_const(), len) }
                } else {
                    // SAFETY: as above, and the check ends here.
                    Err(check.verify(unsafe { core::slice::from_raw_parts(start.cast_const(), len) }))
                };
                match verdict {
                    Err(Ok(())) => {}
                    Err(Err(e)) => {
                        self.refuse_slice(token, (key, attempt), &e);
                        return;
                    }
                    Ok(verdict) => checking = Some((stream.serial, verdict)),
                }
            }
        }
        let Some(entry) = self.landing.get_mut(&key).filter(|e| e.attempt == attempt) else { return };
        entry.received += n as u64;
        if let Some((serial, verdict)) = checking {
            self.stats.checked_later += 1;
            entry.unverified += len as u64;
            let (resets, len) = (entry.resets, len as u64);
            self.checking.push(Checking { token, serial, key, attempt, resets, len, verdict });
            return;
        }
        self.complete_landing(Some(token), key, landing);
    }

    /// Lands `key`'s block if it is whole and checked, and acks it on
    /// connection `token` (if given and still open; else the sender's
    /// next attempt hears it).
    fn complete_landing(&mut self, token: Option<usize>, key: BlockAddr, landing: &mut dyn Landing) {
        let Some(entry) = self.landing.get(&key) else { return };
        if entry.received < entry.total || entry.unverified > 0 {
            return;
        }
        let Some(entry) = self.landing.remove(&key) else { return };
        self.detach_readers(key);
        let status = landing.landed(&key, entry.total);
        if status == AckStatus::Landed {
            self.stats.landed += 1;
            self.stats.bytes_landed += entry.total;
            self.landed.insert(key, (entry.transfer, entry.attempt, self.now_ns));
        }
        let took_us = self.traced_landing(token, key, &entry, Some(status));
        if let Some(token) = token {
            if let Some(took_us) = took_us {
                self.trace_reply(token, (entry.transfer, entry.attempt), entry.total, took_us);
            }
            self.ack(token, (entry.transfer, entry.attempt), key, entry.total, status);
        }
    }

    /// A traced block's landing ended (`status`; none: given back at its
    /// deadline): its event, and its time in µs (none: untraced).
    fn traced_landing(
        &mut self,
        token: Option<usize>,
        key: BlockAddr,
        entry: &Arriving,
        status: Option<AckStatus>,
    ) -> Option<u32> {
        if entry.trace == 0 {
            return None;
        }
        let us = u32::try_from(self.now_ns.saturating_sub(entry.started_ns) / 1000).unwrap_or(u32::MAX).max(1);
        let from = token.and_then(|t| self.streams[t].as_ref()).and_then(|s| s.socket.peer_addr().ok());
        let (trace, bytes) = (entry.trace, entry.total);
        self.trace_event(TraceEvent::Landed { trace, from, target: key, bytes, status, us });
        Some(us)
    }

    /// Queues the time this node took on a traced block, for the ack that
    /// follows on `token` — where its sender took trace ids.
    fn trace_reply(&mut self, token: usize, transfer: (u64, u32), total: u64, took_us: u32) {
        let Some(stream) = self.streams[token].as_mut() else { return };
        if stream.features & FEATURE_TRACE == 0 {
            return;
        }
        let header = FrameHeader::traced(transfer, total, took_us).encode();
        let prefix = stream.prefix();
        stream.push(QueuedFrame::new(None, header, core::ptr::null(), 0, prefix));
    }

    /// Verdicts of payload tags checked on the tag threads: a slice that
    /// passed counts toward its block (which may land now); one that failed
    /// is refused as a slice failing its tag here is.
    fn take_verdicts(&mut self, landing: &mut dyn Landing) -> bool {
        let mut any = false;
        let mut i = 0;
        while i < self.checking.len() {
            let Some(passed) = self.checking[i].verdict.get() else {
                i += 1;
                continue;
            };
            any = true;
            let Checking { token, serial, key, attempt, resets, len, .. } = self.checking.swap_remove(i);
            let current = self.landing.get(&key).is_some_and(|e| e.attempt == attempt && e.resets == resets);
            if !current {
                continue;
            }
            let open = self.streams.get(token).and_then(Option::as_ref).is_some_and(|s| s.serial == serial);
            if passed {
                if let Some(entry) = self.landing.get_mut(&key) {
                    entry.unverified = entry.unverified.saturating_sub(len);
                }
                self.complete_landing(open.then_some(token), key, landing);
            } else if open {
                self.refuse_slice(token, (key, attempt), &AuthError::BadTag);
            } else {
                // Its connection is gone already: the count starts again.
                self.stats.bad_tags += 1;
                if let Some(entry) = self.landing.get_mut(&key) {
                    entry.received = 0;
                    entry.unverified = 0;
                    entry.resets += 1;
                }
                self.detach_readers(key);
                self.settle_checks(key);
            }
        }
        any
    }

    /// Waits for, and drops, the checks still reading `key`'s slot (it is
    /// about to be written again or given back).
    fn settle_checks(&mut self, key: BlockAddr) {
        self.checking.retain(|c| {
            if c.key == key {
                c.verdict.wait();
            }
            c.key != key
        });
    }

    /// The next handshake message of connection `token` arrived: answers
    /// it, or completes the handshake. Returns whether the connection
    /// lives on.
    fn on_handshake(&mut self, token: usize, message: &[u8]) -> bool {
        let Some((key, node)) = self.auth.clone() else { return false };
        let Some(stream) = self.streams[token].as_mut() else { return false };
        let stream_peer = stream.peer;
        let link = core::mem::replace(&mut stream.link, Link::Plain);
        let outcome: Result<Option<Session>, AuthError> = match link {
            Link::Server => {
                let mut hello = [0u8; CLIENT_HELLO_BYTES];
                hello.copy_from_slice(message);
                match crate::auth::nonce() {
                    Err(_) => Err(AuthError::NotAHandshake),
                    Ok(nonce) => match ServerHandshake::answer_up_to(&key, node, nonce, &hello, self.link_version) {
                        Ok((handshake, answer)) => {
                            stream.link = Link::Answered(Some(handshake));
                            stream.handshake_out = answer.to_vec();
                            stream.handshake_sent = 0;
                            Ok(None)
                        }
                        Err((e, answer)) => {
                            // Told why (another key, another version), best
                            // effort, before the close.
                            if let Some(answer) = answer {
                                let _ = stream.socket.write(&answer);
                            }
                            Err(e)
                        }
                    },
                }
            }
            Link::Answered(Some(handshake)) => {
                let mut finish = [0u8; CLIENT_FINISH_BYTES];
                finish.copy_from_slice(message);
                handshake.finish(&finish).map(|(session, _)| Some(session))
            }
            Link::Client(Some(handshake)) => {
                let mut answer = [0u8; SERVER_HELLO_BYTES];
                answer.copy_from_slice(message);
                handshake.finish(&answer).map(|(finish, session, _)| {
                    stream.handshake_out = finish.to_vec();
                    stream.handshake_sent = 0;
                    Some(session)
                })
            }
            _ => Err(AuthError::NotAHandshake),
        };
        match outcome {
            Ok(None) => {
                self.flush(token);
                true
            }
            Ok(Some(session)) => {
                stream.link = Link::Ready(session);
                self.stats.handshakes += 1;
                self.on_connected(token);
                self.flush(token);
                true
            }
            Err(e) => {
                self.stats.handshakes_refused += 1;
                let what = format!("handshake refused: {e}");
                self.security_event(token, &what);
                // A peer that speaks only an older link version (one
                // release behind, in a rolling upgrade) is offered that one
                // from its next connection on, made at once.
                let older = match e {
                    AuthError::Version(v) if crate::auth::handshake::speaks(v) => Some(v),
                    _ => None,
                };
                self.lose(token, &what);
                if let (Some(version), Some((peer, index))) = (older, stream_peer)
                    && let Some(p) = self.peers.get_mut(peer.0 as usize)
                    && version < p.link_version
                {
                    p.link_version = version;
                    p.retry_at[index].0 = self.now_ns;
                    self.note(format!("peer {}: speaking link version {version}, the latest it speaks", peer.0));
                }
                false
            }
        }
    }

    /// A frame's header failed its tag: nothing of it is acted on; the
    /// connection is closed.
    fn refuse_frame(&mut self, token: usize, why: &AuthError) {
        self.stats.bad_tags += 1;
        let what = format!("frame refused: {why}");
        self.security_event(token, &what);
        self.lose(token, &what);
    }

    /// A slice's bytes failed their tag: they never count. The block they
    /// were for waits for its sender's next attempt (its slices of this
    /// attempt on other connections are dropped too), or its deadline;
    /// the connection is closed.
    fn refuse_slice(&mut self, token: usize, (key, attempt): (BlockAddr, u32), why: &AuthError) {
        if let Some(entry) = self.landing.get_mut(&key)
            && entry.attempt == attempt
        {
            entry.received = 0;
            entry.unverified = 0;
            entry.resets += 1;
            self.detach_readers(key);
            self.settle_checks(key);
        }
        self.stats.bad_tags += 1;
        let what = format!("slice for slot {} refused: {why}", key.slot);
        self.security_event(token, &what);
        self.lose(token, &what);
    }

    fn ack(&mut self, token: usize, transfer: (u64, u32), target: BlockAddr, total: u64, status: AckStatus) {
        if let Some(stream) = self.streams[token].as_mut() {
            let header = FrameHeader::ack(transfer, target, total, status).encode();
            let prefix = stream.prefix();
            stream.push(QueuedFrame::new(None, header, core::ptr::null(), 0, prefix));
            if stream.writable {
                self.flush(token);
            }
        }
    }

    /// Passes offers of another transport on inbound links to the owner
    /// ([`TcpTransport::take_negotiations`]) from now on; off (the
    /// default), each is declined at once.
    pub fn negotiate(&mut self, on: bool) {
        self.negotiates = on;
    }

    /// Offers `bytes` (this node's half of another transport for the link,
    /// 1 to [`super::frame::NEGOTIATE_BYTES_MAX`]) to `peer` on its first
    /// connection that may carry frames; the answer comes as
    /// [`Negotiation::Answered`]. None up: an error (offer again later).
    pub fn offer_transport(&mut self, peer: PeerId, bytes: &[u8]) -> Result<(), TcpError> {
        let len = u32::try_from(bytes.len()).ok().filter(|l| (1..=super::frame::NEGOTIATE_BYTES_MAX).contains(l));
        let len =
            len.ok_or_else(|| TcpError(format!("an offer is 1 to {} bytes", super::frame::NEGOTIATE_BYTES_MAX)))?;
        let p = self.peers.get(peer.0 as usize).ok_or_else(|| TcpError("no such peer".into()))?;
        let token = p
            .streams
            .iter()
            .flatten()
            .copied()
            .find(|&t| self.streams[t].as_ref().is_some_and(|s| s.connected))
            .ok_or_else(|| TcpError("no connection to the peer is up".into()))?;
        self.queue_negotiation(token, FrameHeader::negotiate(len), bytes)?;
        if let Some(stream) = self.streams[token].as_mut() {
            stream.offers.push_back(Offered::Owner);
        }
        Ok(())
    }

    /// What every connection up to `peer` agreed to speak beyond the
    /// frames every build reads ([`Features`]; 0 with none up, or before
    /// the peer answered).
    pub fn peer_features(&self, peer: PeerId) -> u64 {
        let Some(p) = self.peers.get(peer.0 as usize) else { return 0 };
        let mut up = p.streams.iter().flatten().filter_map(|&t| self.streams[t].as_ref()).filter(|s| s.connected);
        let first = up.next().map_or(0, |s| s.features);
        up.fold(first, |all, s| all & s.features)
    }

    /// What traced transfers did since the last call, oldest first
    /// (appended to `out`).
    pub fn take_trace_events(&mut self, out: &mut Vec<TraceEvent>) {
        out.append(&mut self.trace_events);
    }

    fn trace_event(&mut self, event: TraceEvent) {
        if self.trace_events.len() < TRACE_EVENTS_MAX {
            self.trace_events.push(event);
        } else {
            self.stats.trace_events_dropped += 1;
        }
    }

    /// Answers the offer made on `to`: this node's half (accepted) or none
    /// (declined). The link closed since: an error, nothing sent.
    pub fn answer_transport(&mut self, to: InboundLink, bytes: Option<&[u8]>) -> Result<(), TcpError> {
        let open = self.streams.get(to.token).and_then(Option::as_ref).is_some_and(|s| s.serial == to.serial);
        if !open {
            return Err(TcpError("the link the offer came on is closed".into()));
        }
        let bytes = bytes.unwrap_or(&[]);
        let len = u32::try_from(bytes.len())
            .ok()
            .filter(|&l| l <= super::frame::NEGOTIATE_BYTES_MAX)
            .ok_or_else(|| TcpError(format!("an answer is at most {} bytes", super::frame::NEGOTIATE_BYTES_MAX)))?;
        self.queue_negotiation(to.token, FrameHeader::negotiated(len), bytes)
    }

    /// Negotiations since the last call, oldest first.
    pub fn take_negotiations(&mut self) -> Vec<Negotiation> {
        core::mem::take(&mut self.negotiations)
    }

    /// Queues a negotiation frame carrying `bytes` (kept with the
    /// connection while it lives).
    fn queue_negotiation(&mut self, token: usize, header: FrameHeader, bytes: &[u8]) -> Result<(), TcpError> {
        let stream = self.streams[token].as_mut().ok_or_else(|| TcpError("connection closed".into()))?;
        if stream.owned.len() >= NEGOTIATIONS_PER_STREAM_MAX {
            return Err(TcpError(format!("{NEGOTIATIONS_PER_STREAM_MAX} negotiations on one connection already")));
        }
        let owned: Box<[u8]> = bytes.into();
        // The boxed bytes do not move while the connection keeps them.
        let at = if owned.is_empty() { core::ptr::null() } else { owned.as_ptr() };
        stream.owned.push(owned);
        let prefix = stream.prefix();
        stream.push(QueuedFrame::new(None, header.encode(), at, bytes.len(), prefix));
        if stream.writable {
            self.flush(token);
        }
        Ok(())
    }

    /// A negotiation frame: an offer on an inbound link (for the owner, or
    /// declined), an answer on an outbound one; either on the wrong side,
    /// or too many, cuts the connection off.
    fn on_negotiation(&mut self, token: usize, kind: FrameKind, bytes: &[u8]) {
        let Some(stream) = self.streams[token].as_mut() else { return };
        stream.state = ReadState::Header;
        stream.negotiations_in += 1;
        let flooded =
            stream.negotiations_in > NEGOTIATIONS_PER_STREAM_MAX || self.negotiations.len() >= NEGOTIATIONS_WAITING_MAX;
        match (kind, stream.peer) {
            _ if flooded => {
                self.stats.bad_frames += 1;
                self.lose(token, "too many negotiations on one connection");
            }
            (FrameKind::Negotiate, None) if Features::is_features(bytes) => {
                // What the writer speaks: this end takes what both do (none
                // where it speaks none: declined, as by a build before).
                let from = InboundLink { token, serial: stream.serial };
                let agreed = Features::decode(bytes).map_or(0, |theirs| theirs.0 & self.config.features);
                stream.features = agreed;
                let answer = Features(agreed).encode();
                let _ = self.answer_transport(from, (self.config.features != 0).then_some(&answer[..]));
            }
            (FrameKind::Negotiate, None) => {
                let from = InboundLink { token, serial: stream.serial };
                let address = stream.socket.peer_addr().ok();
                if self.negotiates {
                    self.negotiations.push(Negotiation::Offered { from, address, bytes: bytes.to_vec() });
                } else {
                    // Not offered to anyone here: TCP it stays.
                    let _ = self.answer_transport(from, None);
                }
            }
            (FrameKind::Negotiated, Some((peer, _))) => {
                // Answers come in the order the offers went.
                if stream.offers.pop_front() == Some(Offered::Features) {
                    let theirs = Features::decode(bytes).map_or(0, |f| f.0);
                    stream.features = theirs & self.config.features;
                    return;
                }
                let bytes = (!bytes.is_empty()).then(|| bytes.to_vec());
                self.negotiations.push(Negotiation::Answered { peer, bytes });
            }
            _ => {
                self.stats.bad_frames += 1;
                self.lose(token, "a negotiation frame on the wrong side of a connection");
            }
        }
    }

    fn on_frame(&mut self, token: usize, frame: &FrameHeader, landing: &mut dyn Landing, now_ns: u64) {
        // Answers to this end's writes name them as they went on the wire:
        // back to the caller's ids.
        let answer = matches!(frame.kind, FrameKind::Ack | FrameKind::Reserved | FrameKind::Traced);
        let unsalted;
        let frame = if answer {
            unsalted = FrameHeader { transfer: frame.transfer.wrapping_sub(self.wire_salt), ..*frame };
            &unsalted
        } else {
            frame
        };
        match frame.kind {
            FrameKind::Ack => {
                // An answer on a rail: it works again; its next break waits
                // the base time.
                if let Some((peer, index)) = self.streams[token].as_ref().and_then(|s| s.peer)
                    && let Some(p) = self.peers.get_mut(peer.0 as usize)
                {
                    p.rails[index / self.config.streams_per_peer].cooldown_ns = RAIL_COOLDOWN_NS;
                }
                let Some(sending) = self.sending.get(&frame.transfer) else { return };
                // A landing is final whichever attempt it answers; any other
                // verdict only for the attempt in flight.
                if frame.status != AckStatus::Landed && frame.attempt != sending.attempt {
                    return;
                }
                let Some(sending) = self.sending.remove(&frame.transfer) else { return };
                if sending.block.trace != 0 {
                    let (trace, peer_us) = (sending.block.trace, sending.peer_us);
                    self.trace_event(TraceEvent::Answered { trace, transfer: frame.transfer, peer_us });
                }
                let result = match frame.status {
                    AckStatus::Landed => {
                        self.stats.sent += 1;
                        self.stats.bytes_sent += frame.total_len;
                        Ok(())
                    }
                    AckStatus::Refused => Err(TransferError::Refused),
                    AckStatus::Corrupt => Err(TransferError::Corrupt),
                    // `Later` answers reservations only (the decoder sees to it).
                    AckStatus::Busy | AckStatus::Later => Err(TransferError::Busy),
                };
                if result.is_err() {
                    self.stats.failed += 1;
                }
                self.done.push(Completion { transfer: frame.transfer, result, target: frame.target });
            }
            FrameKind::Data => self.on_slice(token, frame, landing, now_ns),
            FrameKind::Trace | FrameKind::Traced => self.on_trace(token, frame),
            // A declined offer (the others carry bytes: read whole first).
            FrameKind::Negotiate | FrameKind::Negotiated => self.on_negotiation(token, frame.kind, &[]),
            FrameKind::Reserve => self.on_reserve(token, frame, landing, now_ns),
            FrameKind::Reserved => {
                let Some(sending) = self.sending.get_mut(&frame.transfer) else { return };
                if frame.attempt != sending.attempt || sending.block.target.slot != ANY_SLOT {
                    return;
                }
                if frame.status == AckStatus::Later {
                    // The block's tenant is at the peer's cap on what it
                    // receives: asked again after the wait it named. Waiting
                    // is not failing: the deadline counts from then.
                    let wait_ns = frame.offset.max(LATER_US_MIN) * 1000;
                    sending.deadline_ns = sending.deadline_ns.max(now_ns + wait_ns + self.config.transfer_timeout_ns);
                    sending.streams = 0;
                    self.stats.reservations_later += 1;
                    if self.later.len() < self.later.capacity() {
                        self.later.push((frame.transfer, frame.attempt, now_ns + wait_ns));
                    }
                    return;
                }
                if frame.status != AckStatus::Landed {
                    let Some(sending) = self.sending.remove(&frame.transfer) else { return };
                    let result = Err(match frame.status {
                        AckStatus::Busy => TransferError::Busy,
                        _ => TransferError::Refused,
                    });
                    self.stats.failed += 1;
                    self.done.push(Completion { transfer: frame.transfer, result, target: sending.block.target });
                    return;
                }
                // A slot of the region asked for: the block goes there.
                let (asked, given) = (sending.block.target, frame.target);
                if given.region != asked.region || given.epoch != asked.epoch || given.slot == ANY_SLOT {
                    return;
                }
                let mut sending = match self.sending.remove(&frame.transfer) {
                    Some(sending) => sending,
                    None => return,
                };
                sending.block.target = given;
                let peer = sending.block.peer;
                if self.queue_slices(&mut sending, true).is_ok() {
                    self.sending.insert(frame.transfer, sending);
                    self.feed(peer);
                }
            }
        }
    }

    /// A trace frame: on an inbound connection, the id of the block whose
    /// data follows (kept with its landing); on an outbound one, the
    /// peer's time on a block of this end's, before its ack. The wrong
    /// way round, the connection is cut off.
    fn on_trace(&mut self, token: usize, frame: &FrameHeader) {
        let Some(stream) = self.streams[token].as_mut() else { return };
        match (frame.kind, stream.peer.is_some()) {
            (FrameKind::Trace, false) => {
                let (key, transfer, trace) = (frame.target, frame.transfer, frame.trace_id());
                match self.landing.get_mut(&key) {
                    Some(entry) if entry.transfer == transfer => {
                        if entry.trace == 0 {
                            entry.trace = trace;
                        }
                    }
                    // Its first slice is next on this connection.
                    _ => stream.trace_next = Some((key, transfer, trace)),
                }
            }
            (FrameKind::Traced, true) => {
                if let Some(sending) = self.sending.get_mut(&frame.transfer)
                    && sending.attempt == frame.attempt
                {
                    sending.peer_us = frame.took_us().max(1);
                }
            }
            _ => {
                self.stats.bad_frames += 1;
                self.lose(token, "a trace frame on the wrong side of a connection");
            }
        }
    }

    /// A peer asks for a slot: the node reserves one (or refuses), the
    /// transport places it and answers. Asked again for the same transfer
    /// (its sender did not hear the answer), the same slot is given.
    fn on_reserve(&mut self, token: usize, frame: &FrameHeader, landing: &mut dyn Landing, now_ns: u64) {
        let key = (frame.transfer, frame.attempt);
        let known = self.landing.iter().find(|(_, a)| a.transfer == frame.transfer).map(|(&target, _)| target);
        let full = self.landing.len() >= self.config.landing_max;
        // The block's namespace, where the sender names it: a tenant at its
        // cap on what this node receives is told to ask again after the
        // wait, and its sender holds the block meanwhile.
        let tenants = self.streams[token].as_ref().is_some_and(|s| s.features & FEATURE_TENANT != 0);
        if tenants
            && frame.offset != 0
            && known.is_none()
            && !full
            && let Err(wait_us) = landing.admit(frame.offset, frame.total_len, now_ns)
        {
            self.stats.reservations_held += 1;
            let later = FrameHeader::later(key, frame.target, frame.total_len, wait_us.max(LATER_US_MIN));
            self.answer_reservation(token, later);
            return;
        }
        let answer = match known {
            Some(target) => Ok(target),
            None if full => Err(AckStatus::Busy),
            None => landing.reserve(frame.target.region, frame.target.epoch, frame.total_len).and_then(|target| {
                let base = landing.place(&target, frame.total_len)?;
                self.landing.insert(
                    target,
                    Arriving {
                        transfer: frame.transfer,
                        attempt: frame.attempt,
                        base,
                        total: frame.total_len,
                        received: 0,
                        unverified: 0,
                        resets: 0,
                        deadline_ns: now_ns + self.config.transfer_timeout_ns,
                        trace: 0,
                        started_ns: now_ns,
                    },
                );
                Ok(target)
            }),
        };
        let (target, status) = match answer {
            Ok(target) => (target, AckStatus::Landed),
            Err(status) => (frame.target, status),
        };
        self.answer_reservation(token, FrameHeader::reserved(key, target, frame.total_len, status));
    }

    /// Queues the answer to a reservation on the connection it came by.
    fn answer_reservation(&mut self, token: usize, answer: FrameHeader) {
        if let Some(stream) = self.streams[token].as_mut() {
            let prefix = stream.prefix();
            stream.push(QueuedFrame::new(None, answer.encode(), core::ptr::null(), 0, prefix));
            if stream.writable {
                self.flush(token);
            }
        }
    }

    /// A slice's header: where its bytes go, or that they are dropped.
    fn on_slice(&mut self, token: usize, frame: &FrameHeader, landing: &mut dyn Landing, now_ns: u64) {
        enum Verdict {
            Into(*mut u8),
            Drop,
            Answer(AckStatus),
        }
        let key = frame.target;
        let full = self.landing.len() >= self.config.landing_max;
        let mut restarted = false;
        // A trace id named for this data frame (on this connection, just
        // before it) goes with its landing.
        let traced = self.streams[token].as_mut().and_then(|s| s.trace_next.take());
        let verdict = match self.landing.get_mut(&key) {
            Some(entry) if entry.transfer == frame.transfer && entry.total == frame.total_len => {
                if frame.attempt == entry.attempt {
                    Verdict::Into(entry.base)
                } else if frame.attempt > entry.attempt {
                    // Sent again (a connection broke): start over.
                    entry.attempt = frame.attempt;
                    entry.received = 0;
                    restarted = true;
                    Verdict::Into(entry.base)
                } else {
                    Verdict::Drop
                }
            }
            Some(_) => Verdict::Answer(AckStatus::Refused),
            None => match self.landed.get_mut(&key) {
                // Landed already; the sender did not hear so.
                Some((transfer, acked, _)) if *transfer == frame.transfer => {
                    if frame.attempt > *acked {
                        *acked = frame.attempt;
                        Verdict::Answer(AckStatus::Landed)
                    } else {
                        Verdict::Drop
                    }
                }
                _ if full => Verdict::Answer(AckStatus::Busy),
                _ => match landing.place(&key, frame.total_len) {
                    Ok(base) => {
                        self.landing.insert(
                            key,
                            Arriving {
                                transfer: frame.transfer,
                                attempt: frame.attempt,
                                base,
                                total: frame.total_len,
                                received: 0,
                                unverified: 0,
                                resets: 0,
                                deadline_ns: now_ns + self.config.transfer_timeout_ns,
                                trace: 0,
                                started_ns: now_ns,
                            },
                        );
                        Verdict::Into(base)
                    }
                    Err(status) => Verdict::Answer(status),
                },
            },
        };
        if let (Verdict::Into(_), Some((at, transfer, trace))) = (&verdict, traced)
            && at == key
            && transfer == frame.transfer
            && let Some(entry) = self.landing.get_mut(&key)
            && entry.trace == 0
        {
            entry.trace = trace;
        }
        if restarted {
            // Slices of the older attempt still arriving on other
            // connections must not write into the slot any more, nor tag
            // threads read it.
            self.detach_readers(key);
            self.settle_checks(key);
            if let Some(entry) = self.landing.get_mut(&key) {
                entry.unverified = 0;
            }
        }
        let len = frame.slice_len as usize;
        let Some(stream) = self.streams[token].as_mut() else { return };
        match verdict {
            Verdict::Into(base) => {
                let at = base.wrapping_add(bytes(frame.offset));
                stream.state = ReadState::Slice { key, attempt: frame.attempt, at, left: len, start: at, len };
                stream.large_slices = len >= DIRECT_READ_MIN;
            }
            Verdict::Drop => {
                stream.state = ReadState::Discard { left: len };
                stream.payload_check = None;
            }
            Verdict::Answer(status) => {
                stream.state = ReadState::Discard { left: len };
                stream.payload_check = None;
                self.ack(token, (frame.transfer, frame.attempt), key, frame.total_len, status);
            }
        }
    }

    /// Connections reading a slice into `key`'s slot read the rest of it
    /// into nowhere: the slot is no longer theirs to write (its block
    /// landed, was given back, or is being sent again).
    fn detach_readers(&mut self, key: BlockAddr) {
        for stream in self.streams.iter_mut().flatten() {
            if let ReadState::Slice { key: k, left, .. } = stream.state
                && k == key
            {
                stream.state = ReadState::Discard { left };
            }
        }
    }

    /// Writes what the connection has queued, many frames a call.
    fn flush(&mut self, token: usize) -> bool {
        let mut busy = false;
        loop {
            let Some(stream) = self.streams[token].as_mut() else { return busy };
            // Handshake bytes before anything else.
            while stream.handshake_pending() {
                match stream.socket.write(&stream.handshake_out[stream.handshake_sent..]) {
                    Ok(0) => {
                        self.lose(token, "the connection took no bytes");
                        return true;
                    }
                    Ok(n) => {
                        stream.handshake_sent += n;
                        stream.progress_ns = self.now_ns;
                        busy = true;
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        stream.writable = false;
                        return busy;
                    }
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => {
                        self.lose(token, &e.to_string());
                        return true;
                    }
                }
            }
            if !stream.connected || stream.queue.is_empty() {
                return busy;
            }
            self.stats.sealed_later += seal_ahead(stream, self.config.tags_later);
            let authenticated = !matches!(stream.link, Link::Plain);
            // Frames whose tags are made go; one still being tagged holds
            // those behind it (a frame's tags follow the ones before it).
            let mut going = 0;
            for frame in stream.queue.iter_mut().take(FRAMES_PER_WRITE) {
                if !frame.ready(authenticated) {
                    break;
                }
                going += 1;
            }
            if going == 0 {
                return busy;
            }
            let mut slices: [IoSlice<'_>; FRAMES_PER_WRITE * 2] = [IoSlice::new(&[]); FRAMES_PER_WRITE * 2];
            let mut count = 0;
            for frame in stream.queue.iter().take(going) {
                if frame.sent < frame.prefix {
                    slices[count] = IoSlice::new(&frame.header[frame.sent..frame.prefix]);
                    count += 1;
                }
                if frame.len > 0 {
                    let from = frame.sent.saturating_sub(frame.prefix);
                    let start = frame.bytes.wrapping_add(from);
                    // SAFETY: the caller of `write` keeps the source valid
                    // for `len` bytes until the transfer completes.
                    let bytes = unsafe { core::slice::from_raw_parts(start, frame.len - from) };
                    slices[count] = IoSlice::new(bytes);
                    count += 1;
                }
            }
            self.stats.write_calls += 1;
            match stream.socket.write_vectored(&slices[..count]) {
                Ok(0) => {
                    self.lose(token, "the connection took no bytes");
                    return true;
                }
                Ok(mut n) => {
                    busy = true;
                    stream.queued_bytes -= n;
                    // Held by the kernel now, until the next time it is asked.
                    stream.unsent += n;
                    stream.progress_ns = self.now_ns;
                    if let Some((peer, index)) = stream.peer
                        && let Some(p) = self.peers.get_mut(peer.0 as usize)
                    {
                        p.rails[index / self.config.streams_per_peer].bytes += n as u64;
                    }
                    let mut wrote: [Option<u64>; FRAMES_PER_WRITE] = [None; FRAMES_PER_WRITE];
                    let mut touched = 0;
                    while n > 0 {
                        let Some(front) = stream.queue.front_mut() else { break };
                        // A slice's bytes went out: its transfer is past
                        // cancelling.
                        if front.len > 0 && touched < FRAMES_PER_WRITE {
                            wrote[touched] = front.transfer;
                            touched += 1;
                        }
                        let left = front.total() - front.sent;
                        if n >= left {
                            n -= left;
                            stream.queue.pop_front();
                        } else {
                            front.sent += n;
                            n = 0;
                        }
                    }
                    let stream_peer = stream.peer;
                    for transfer in wrote[..touched].iter().flatten() {
                        if let Some(sending) = self.sending.get_mut(transfer) {
                            sending.wrote = true;
                        }
                    }
                    // Room again: more of the peer's slices.
                    if let Some((peer, _)) = stream_peer
                        && self.peers.get(peer.0 as usize).is_some_and(|p| p.pending.iter().any(|q| !q.is_empty()))
                    {
                        self.feed(peer);
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    stream.writable = false;
                    return busy;
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    self.lose(token, &e.to_string());
                    return true;
                }
            }
        }
    }

    /// A connection is gone. Each transfer that had a slice on it is sent
    /// again, whole, over the peer's other connections (at most
    /// [`ATTEMPTS_MAX`] sendings), or fails; an outbound connection is
    /// tried again later. Blocks landing here through it wait for their
    /// sender's next attempt, or their deadline.
    fn lose(&mut self, token: usize, why: &str) {
        let Some(mut stream) = self.streams[token].take() else { return };
        // Tags still being made read their frames' sources: done first.
        settle(&stream);
        let _ = self.poll.registry().deregister(&mut stream.socket);
        self.stats.streams_lost += 1;
        let Some((peer, index)) = stream.peer else { return };
        if let Some(p) = self.peers.get_mut(peer.0 as usize) {
            p.streams[index] = None;
            p.last_break = Some(why.to_string());
            // A link that was up broke: the peer may come back upgraded,
            // so the next handshake offers this node's latest again.
            if stream.connected {
                p.link_version = self.link_version;
            }
            let (_, wait) = p.retry_at[index];
            p.retry_at[index] = (self.now_ns + wait, (wait * 2).min(self.config.reconnect_ns * 64));
            // Its rail is passed over for a while (one cooldown per break,
            // not per connection: they often break together).
            let rail = &mut p.rails[index / self.config.streams_per_peer];
            if rail.cooldown_until <= self.now_ns {
                rail.cooldown_until = self.now_ns + rail.cooldown_ns;
                rail.cooldown_ns = (rail.cooldown_ns * 2).min(RAIL_COOLDOWN_NS * 64);
                rail.breaks += 1;
                self.stats.rail_cooldowns += 1;
            }
        }
        let hit: Vec<u64> = self
            .sending
            .iter()
            .filter(|(_, s)| s.block.peer == peer && s.streams & (1 << index) != 0)
            .map(|(&t, _)| t)
            .collect();
        for transfer in hit {
            let Some(mut sending) = self.sending.remove(&transfer) else { continue };
            // Its slices still queued elsewhere are of the old attempt.
            self.unqueue(peer, transfer);
            let attempts = u32::try_from(self.config.streams_per_peer).unwrap_or(u32::MAX) + EXTRA_ATTEMPTS;
            let retried = sending.attempt + 1 < attempts && {
                sending.attempt += 1;
                self.queue_slices(&mut sending, true).is_ok()
            };
            if retried {
                self.stats.retried += 1;
                self.sending.insert(transfer, sending);
            } else {
                self.stats.failed += 1;
                self.done.push(Completion {
                    transfer,
                    result: Err(TransferError::PeerLost(format!("connection {index} to the peer: {why}"))),
                    target: sending.block.target,
                });
            }
        }
        self.feed(peer);
    }

    /// Cancels `transfer` if none of its bytes went out yet (its slices
    /// still wait for a connection, or are queued untouched and untagged):
    /// it ends `Cancelled` at the next poll, and its source is the caller's
    /// again then. One with a slice written or tagged goes on to its end
    /// (the stream's framing and count need it whole): `false` then, or for
    /// a transfer not in flight. A slot the peer reserved for it (sent to
    /// `ANY_SLOT`) is given back there at its deadline.
    pub fn cancel(&mut self, transfer: u64) -> bool {
        let Some(sending) = self.sending.get(&transfer) else { return false };
        if sending.wrote {
            return false;
        }
        let peer = sending.block.peer;
        let Some(p) = self.peers.get(peer.0 as usize) else { return false };
        let started = p.streams.iter().flatten().any(|&t| {
            self.streams[t]
                .as_ref()
                .is_some_and(|s| s.queue.iter().any(|f| f.transfer == Some(transfer) && (f.sent > 0 || f.sealed)))
        });
        if started {
            return false;
        }
        let Some(sending) = self.sending.remove(&transfer) else { return false };
        if let Some(p) = self.peers.get_mut(peer.0 as usize) {
            for class in &mut p.pending {
                class.retain(|s| s.transfer != transfer);
            }
        }
        self.unqueue(peer, transfer);
        self.stats.failed += 1;
        self.done.push(Completion { transfer, result: Err(TransferError::Cancelled), target: sending.block.target });
        true
    }

    /// Drops the frames of `transfer` not yet started from `peer`'s
    /// connections (one partly written must finish: the stream's framing).
    fn unqueue(&mut self, peer: PeerId, transfer: u64) {
        let Some(p) = self.peers.get(peer.0 as usize) else { return };
        for token in p.streams.iter().flatten() {
            let Some(stream) = self.streams[*token].as_mut() else { continue };
            let before = stream.queue.len();
            let mut dropped = 0;
            stream.queue.retain(|f| {
                let drop = f.transfer == Some(transfer) && f.sent == 0 && !f.sealed;
                if drop {
                    dropped += f.total();
                }
                !drop
            });
            if stream.queue.len() != before {
                stream.queued_bytes -= dropped;
            }
        }
    }

    /// Reservations answered `Later` whose wait is over: asked again,
    /// behind what waits already.
    fn ask_again(&mut self, now_ns: u64) {
        let mut at = 0;
        while at < self.later.len() {
            let (transfer, attempt, when_ns) = self.later[at];
            if when_ns > now_ns {
                at += 1;
                continue;
            }
            self.later.swap_remove(at);
            let Some(mut sending) = self.sending.remove(&transfer) else { continue };
            if sending.attempt != attempt {
                self.sending.insert(transfer, sending);
                continue;
            }
            let peer = sending.block.peer;
            if self.queue_slices(&mut sending, false).is_ok() {
                self.sending.insert(transfer, sending);
                self.feed(peer);
            } else {
                self.stats.failed += 1;
                self.done.push(Completion {
                    transfer,
                    result: Err(TransferError::Invalid("peer")),
                    target: sending.block.target,
                });
            }
        }
    }

    /// Deadlines, stalls, reconnects, abandoned landings.
    fn sweep(&mut self, landing: &mut dyn Landing, now_ns: u64) {
        self.ask_again(now_ns);
        // Connections that stopped moving: a cut link sends no error for
        // minutes, so silence with bytes to move counts as a break.
        for token in 0..self.streams.len() {
            let Some(stream) = self.streams[token].as_mut() else { continue };
            let late = now_ns.saturating_sub(stream.progress_ns) > self.config.stall_ns;
            let why = if stream.up && stream.handshaking() {
                if late {
                    self.stats.handshakes_refused += 1;
                    self.security_event(token, "handshake refused: not done in time");
                }
                late.then_some("the handshake was not done in time")
            } else if !stream.connected {
                late.then_some("connect timed out")
            } else {
                let owed = !stream.queue.is_empty() || stream.kernel_unsent(now_ns) > 0;
                (owed && now_ns.saturating_sub(stream.progress_ns) > self.config.stall_ns)
                    .then_some("stalled: nothing moved with bytes to move")
            };
            if let Some(why) = why {
                self.lose(token, why);
            }
        }
        let late: Vec<u64> = self.sending.iter().filter(|(_, s)| s.deadline_ns <= now_ns).map(|(&t, _)| t).collect();
        for transfer in late {
            let Some(sending) = self.sending.remove(&transfer) else { continue };
            self.unqueue(sending.block.peer, transfer);
            self.stats.failed += 1;
            let result = if sending.streams == 0 && self.connected(sending.block.peer) == 0 {
                let last = self.peers.get(sending.block.peer.0 as usize).and_then(|p| p.last_break.as_deref());
                let why = last.map_or_else(String::new, |why| format!(" (the last one broke: {why})"));
                Err(TransferError::PeerLost(format!("no connection to the peer came up before the deadline{why}")))
            } else {
                Err(TransferError::Timeout)
            };
            self.done.push(Completion { transfer, result, target: sending.block.target });
        }
        let stale: Vec<BlockAddr> =
            self.landing.iter().filter(|(_, l)| l.deadline_ns <= now_ns).map(|(&k, _)| k).collect();
        for key in stale {
            if let Some(entry) = self.landing.remove(&key) {
                self.traced_landing(None, key, &entry, None);
            }
            // Nothing writes into the slot once it is given back, nor
            // reads it.
            self.detach_readers(key);
            self.settle_checks(key);
            landing.abandoned(&key);
        }
        let keep_ns = self.config.transfer_timeout_ns;
        self.landed.retain(|_, &mut (_, _, at)| now_ns.saturating_sub(at) < keep_ns);
        for peer in 0..self.peers.len() {
            for index in 0..self.peers[peer].streams.len() {
                let (at, _) = self.peers[peer].retry_at[index];
                if self.peers[peer].streams[index].is_none() && at <= now_ns {
                    let id = PeerId(u32::try_from(peer).unwrap_or(u32::MAX));
                    if self.connect(id, index).is_err() {
                        let (_, wait) = self.peers[peer].retry_at[index];
                        self.peers[peer].retry_at[index] =
                            (now_ns + wait, (wait * 2).min(self.config.reconnect_ns * 64));
                    }
                }
            }
        }
    }
}

/// A non-blocking connection to `remote` leaving from `local` (a rail's
/// interface): bound first, then connected.
/// Waits for the tags still being made for `stream`'s frames (their tag
/// threads read the frames' bytes).
fn settle(stream: &Stream) {
    for frame in &stream.queue {
        if let Some(later) = &frame.later {
            later.wait();
        }
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        // No tag thread may read a source or a slot once the transport is
        // gone and its callers take their memory back.
        for stream in self.streams.iter().flatten() {
            settle(stream);
        }
        for check in &self.checking {
            check.verdict.wait();
        }
    }
}

/// Tags for the frames about to go on an authenticated connection, in the
/// order they go (a few MiB ahead at most); a large payload's are made on
/// the tag threads while the connection sends what is ready.
/// Returns how many frames' tags went to the tag threads.
fn seal_ahead(stream: &mut Stream, later: bool) -> u64 {
    let Link::Ready(session) = &mut stream.link else { return 0 };
    let (mut ahead, mut sent_off) = (0, 0);
    for frame in stream.queue.iter_mut().take(FRAMES_PER_WRITE) {
        if !frame.sealed {
            if ahead > SEAL_AHEAD_BYTES {
                break;
            }
            let mut header = [0u8; FRAME_HEADER_BYTES];
            header.copy_from_slice(&frame.header[..FRAME_HEADER_BYTES]);
            // The caller of `write` keeps the source valid and unchanged
            // for `len` bytes until the transfer completes, and a
            // transfer's completion is held while a frame of it is queued
            // (`TcpTransport::release_done`) or being tagged (`settle`); a
            // frame's own bytes live with its connection.
            let sealed = if later {
                // SAFETY: as just said.
                unsafe { session.seal_later(&header, frame.bytes, frame.len) }
            } else if frame.len == 0 {
                Err(session.seal(&header, &[]))
            } else {
                // SAFETY: as just said.
                Err(session.seal(&header, unsafe { core::slice::from_raw_parts(frame.bytes, frame.len) }))
            };
            match sealed {
                Ok(later) => {
                    frame.later = Some(later);
                    sent_off += 1;
                }
                Err(tags) => frame.header[FRAME_HEADER_BYTES..].copy_from_slice(&tags),
            }
            frame.sealed = true;
        }
        ahead += frame.total() - frame.sent;
    }
    sent_off
}

fn connect_from(local: std::net::IpAddr, remote: SocketAddr) -> std::io::Result<TcpStream> {
    use std::os::fd::FromRawFd;
    let domain = if remote.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 };
    // SAFETY: plain socket creation; the descriptor is owned below.
    let fd = unsafe { libc::socket(domain, libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor this function owns from here on (closed
    // on every error path by the std stream's drop).
    let owned = unsafe { std::net::TcpStream::from_raw_fd(fd) };
    let (bind_to, bind_len) = socket_address(SocketAddr::new(local, 0));
    // SAFETY: a valid socket and a sockaddr of the length given.
    if unsafe { libc::bind(fd, (&raw const bind_to).cast(), bind_len) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let (to, to_len) = socket_address(remote);
    // SAFETY: as above.
    if unsafe { libc::connect(fd, (&raw const to).cast(), to_len) } != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINPROGRESS) {
            return Err(e);
        }
    }
    Ok(TcpStream::from_std(owned))
}

/// `address` as a C socket address and its length.
fn socket_address(address: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: all-zero is a valid sockaddr_storage.
    let mut storage: libc::sockaddr_storage = unsafe { core::mem::zeroed() };
    let len = match address {
        SocketAddr::V4(v4) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::sa_family_t::try_from(libc::AF_INET).unwrap_or(0),
                sin_port: v4.port().to_be(),
                sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(v4.ip().octets()) },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is large and aligned enough for any
            // socket address.
            unsafe { (&raw mut storage).cast::<libc::sockaddr_in>().write(sin) };
            size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(v6) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::sa_family_t::try_from(libc::AF_INET6).unwrap_or(0),
                sin6_port: v6.port().to_be(),
                sin6_flowinfo: v6.flowinfo(),
                sin6_addr: libc::in6_addr { s6_addr: v6.ip().octets() },
                sin6_scope_id: v6.scope_id(),
            };
            // SAFETY: as above.
            unsafe { (&raw mut storage).cast::<libc::sockaddr_in6>().write(sin6) };
            size_of::<libc::sockaddr_in6>()
        }
    };
    (storage, libc::socklen_t::try_from(len).unwrap_or(0))
}

/// A length or offset inside one object as an address offset: objects are
/// at most [`OBJECT_BYTES_MAX`](super::frame::OBJECT_BYTES_MAX) bytes,
/// which an address always holds.
/// 64 bits from the process's random hashing keys (the OS's randomness),
/// mixed with the time: not a secret, only unlikely to meet another's.
fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    hasher.write_u32(std::process::id());
    hasher.finish()
}

fn bytes(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

fn bad_frame(e: FrameError) -> String {
    format!("bad frame: {e}")
}

#[cfg(test)]
mod rail_tests {
    use super::Rail;

    #[test]
    fn a_rail_is_an_address_with_an_optional_local_one() {
        let bare = Rail::parse("10.0.0.2:7000").unwrap();
        assert_eq!((bare.remote.to_string(), bare.local), ("10.0.0.2:7000".to_owned(), None));
        let nic = Rail::parse("10.0.1.1>10.0.1.2:7000").unwrap();
        assert_eq!(nic.to_string(), "10.0.1.1>10.0.1.2:7000", "written back as given");
        assert!(Rail::parse("10.0.1.1>").unwrap_err().starts_with("address"));
        assert!(Rail::parse("nic0>10.0.1.2:7000").unwrap_err().starts_with("local address"));
        assert!(Rail::parse("10.0.1.2").unwrap_err().starts_with("address"), "a port is needed");
        let two = Rail::parse_list("127.0.0.1>127.0.0.1:9,127.0.0.2>127.0.0.1:9").unwrap();
        assert_eq!(two.len(), 2);
        assert!(Rail::parse_list(&vec!["127.0.0.1:9"; 65].join(",")).is_err(), "more rails than connections");
        assert!(Rail::parse_list("").is_err());
    }
}
