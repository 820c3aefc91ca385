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

mod negotiate;
mod rails;
mod receive;
mod send;
mod stream;

use std::collections::HashMap;
use std::net::SocketAddr;

use mio::net::TcpListener;
use mio::{Events, Interest, Poll, Token};

use super::frame::{AckStatus, BlockAddr, FEATURES_SPOKEN, FRAME_HEADER_BYTES, FrameError};
use super::{Completion, Landing};
use crate::auth::{ClientHandshake, LinkKey, TAGS_BYTES};
use rails::Peer;
pub use rails::{Rail, RailReport};
use receive::{Arriving, Checking};
use send::Sending;
use stream::{Link, Stream, settle};

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
    /// Inbound connections held at once, at most: one past it is accepted
    /// and closed at once (each holds a descriptor and a receive buffer).
    pub inbound_max: usize,
    /// An inbound connection that brings no byte this long after it was
    /// accepted is closed: a peer's connections send their handshake or
    /// their first frame at once.
    pub silent_ns: u64,
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
            inbound_max: 256,
            silent_ns: 10_000_000_000,
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

impl core::fmt::Display for Rail {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self.local {
            Some(local) => write!(f, "{local}>{}", self.remote),
            None => write!(f, "{}", self.remote),
        }
    }
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
    /// Inbound connections closed as they came: [`TcpConfig::inbound_max`]
    /// were open.
    pub inbound_over_cap: u64,
    /// Inbound connections closed for bringing nothing in
    /// [`TcpConfig::silent_ns`].
    pub inbound_silent: u64,
    /// Accepts that failed (out of file descriptors, most often); the
    /// connection waits in the kernel's queue for a later pass.
    pub accept_failed: u64,
}

/// The shortest wait between a reservation answered `Later` and the next
/// ask, µs.
const LATER_US_MIN: u64 = 200;

/// Why the transport could not start, take a peer, or send a negotiation.
/// (A transfer's own failures are [`TransferError`]s, through its
/// completion.)
#[derive(Debug)]
pub enum TcpError {
    /// A setting out of its range: which, and the range.
    Setting(String),
    /// Called out of order: what must come first.
    Order(&'static str),
    /// A system call failed: what was being done, and the kernel's error.
    Io {
        /// What was being done.
        what: &'static str,
        /// The kernel's error.
        error: std::io::Error,
    },
    /// No peer has that id.
    NoPeer,
    /// No connection is up to carry it: which.
    Closed(&'static str),
    /// A negotiation's bytes out of their bounds: the bounds.
    Size(String),
    /// A connection has as many negotiations waiting as it holds.
    Busy,
}

impl core::fmt::Display for TcpError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Setting(what) | Self::Size(what) => f.write_str(what),
            Self::Order(what) | Self::Closed(what) => f.write_str(what),
            Self::Io { what, error } => write!(f, "{what}: {error}"),
            Self::NoPeer => f.write_str("no such peer"),
            Self::Busy => write!(f, "{NEGOTIATIONS_PER_STREAM_MAX} negotiations on one connection already"),
        }
    }
}

impl std::error::Error for TcpError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Io { error, .. } => Some(error),
            _ => None,
        }
    }
}

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

fn io_error(what: &'static str) -> impl Fn(std::io::Error) -> TcpError {
    move |error| TcpError::Io { what, error }
}

impl TcpTransport {
    /// A transport; listening on `listen` if given (port 0: any).
    pub fn new(config: TcpConfig, listen: Option<SocketAddr>) -> Result<Self, TcpError> {
        if config.inbound_max == 0 {
            return Err(TcpError::Setting("inbound_max is at least 1".into()));
        }
        if config.streams_per_peer == 0 || config.streams_per_peer > STREAMS_PER_PEER_MAX {
            return Err(TcpError::Setting(format!("streams_per_peer is 1..={STREAMS_PER_PEER_MAX}")));
        }
        if config.slice_bytes == 0 || config.slice_bytes > super::frame::SLICE_BYTES_MAX {
            return Err(TcpError::Setting(format!("slice_bytes is 1..={}", super::frame::SLICE_BYTES_MAX)));
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
            return Err(TcpError::Order("authenticate before adding peers or accepting connections"));
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
            return Err(TcpError::Setting(format!(
                "link version {latest}: this build speaks {} to {}",
                crate::auth::handshake::AUTH_VERSION_MIN,
                crate::auth::handshake::AUTH_VERSION
            )));
        }
        if !self.peers.is_empty() {
            return Err(TcpError::Order("set the link version before adding peers"));
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
