//! One connection: its frames waiting to go out, how far its read has
//! come, its handshake; connections made, accepted and lost.

use std::io::ErrorKind;
use std::net::SocketAddr;

use mio::net::TcpStream;
use mio::{Interest, Token};

use super::negotiate::Offered;
use super::rails::RAIL_COOLDOWN_NS;
use super::send::EXTRA_ATTEMPTS;
use super::{
    FRAMES_PER_WRITE, HANDSHAKING_MAX, RECV_BUFFER_BYTES, SEAL_AHEAD_BYTES, SEALED_PREFIX_BYTES, TcpTransport,
};
use crate::auth::{ClientHandshake, Later, PayloadCheck, ServerHandshake, Session, TAGS_BYTES};
use crate::transport::PeerId;
use crate::transport::frame::{BlockAddr, FEATURES_LEN, FRAME_HEADER_BYTES, Features, FrameHeader, FrameKind};
use crate::transport::{Completion, TransferError};

/// A frame waiting to go out on a connection: its prefix (header, and its
/// tags on an authenticated connection), then `len` bytes at `bytes`
/// (none for an ack), `sent` of the two so far.
pub(super) struct QueuedFrame {
    /// The transfer a data frame belongs to (acks: none).
    pub(super) transfer: Option<u64>,
    pub(super) header: [u8; SEALED_PREFIX_BYTES],
    /// Bytes of `header` sent: [`FRAME_HEADER_BYTES`], or
    /// [`SEALED_PREFIX_BYTES`] once sealed.
    pub(super) prefix: usize,
    /// Its tags are made (its place in the connection's sequence taken):
    /// it must go out, even if its transfer ends first.
    pub(super) sealed: bool,
    /// Its tags, being made on the tag threads (sealed, not ready yet).
    pub(super) later: Option<Later<[u8; TAGS_BYTES]>>,
    pub(super) bytes: *const u8,
    pub(super) len: usize,
    pub(super) sent: usize,
}

impl QueuedFrame {
    pub(super) fn new(
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

    pub(super) fn total(&self) -> usize {
        self.prefix + self.len
    }

    /// Whether it may go out: sealed with its tags in place (or on a
    /// plain link).
    pub(super) fn ready(&mut self, authenticated: bool) -> bool {
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
pub(super) enum Link {
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
pub(super) enum ReadState {
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

pub(super) struct Stream {
    pub(super) socket: TcpStream,
    /// Outbound: the peer it serves and its index among the peer's.
    pub(super) peer: Option<(PeerId, usize)>,
    /// The TCP connection is up.
    pub(super) up: bool,
    /// Frames may go: up, and authenticated where a key is set.
    pub(super) connected: bool,
    pub(super) link: Link,
    /// Handshake bytes to write before any frame, and how many went.
    pub(super) handshake_out: Vec<u8>,
    pub(super) handshake_sent: usize,
    /// What the slice being read must hash to (authenticated links).
    pub(super) payload_check: Option<PayloadCheck>,
    pub(super) readable: bool,
    pub(super) writable: bool,
    pub(super) queue: std::collections::VecDeque<QueuedFrame>,
    pub(super) queued_bytes: usize,
    pub(super) buffer: Box<[u8]>,
    /// Bytes of `buffer` read, and parsed.
    pub(super) filled: usize,
    /// The last slice was large (read mostly straight into its target).
    pub(super) large_slices: bool,
    /// Bytes the kernel held unacknowledged when last asked, and when.
    pub(super) unsent: usize,
    pub(super) unsent_at: u64,
    /// When bytes last moved on it (or it was made).
    pub(super) progress_ns: u64,
    /// Some byte came in on it.
    pub(super) heard: bool,
    pub(super) parsed: usize,
    pub(super) state: ReadState,
    /// Which connection this is (a reused token is another).
    pub(super) serial: u64,
    /// Bytes of the negotiation frames queued on it, kept while it lives.
    pub(super) owned: Vec<Box<[u8]>>,
    /// Negotiation frames it brought.
    pub(super) negotiations_in: usize,
    /// What both ends speak beyond the frames every build reads
    /// ([`Features`]): 0 until agreed.
    pub(super) features: u64,
    /// Outbound: the offers made on it, oldest first, answered in order.
    pub(super) offers: std::collections::VecDeque<Offered>,
    /// Inbound: the trace id named for the data frame that follows
    /// (its target, transfer, id).
    pub(super) trace_next: Option<(BlockAddr, u64, u64)>,
}

impl Stream {
    pub(super) fn new(socket: TcpStream, peer: Option<(PeerId, usize)>, up: bool, link: Link, now_ns: u64) -> Self {
        Self {
            progress_ns: now_ns,
            heard: false,
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
    pub(super) fn kernel_unsent(&mut self, now_ns: u64) -> usize {
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

    pub(super) fn push(&mut self, frame: QueuedFrame) {
        self.queued_bytes += frame.total() - frame.sent;
        self.queue.push_back(frame);
    }

    /// Bytes before a frame's slice on this connection.
    pub(super) fn prefix(&self) -> usize {
        if matches!(self.link, Link::Plain) { FRAME_HEADER_BYTES } else { SEALED_PREFIX_BYTES }
    }

    /// Whether it has bytes to write and may write them now.
    pub(super) fn wants_write(&self) -> bool {
        self.up && self.writable && (self.handshake_pending() || (self.connected && !self.queue.is_empty()))
    }

    /// Handshake bytes still to write.
    pub(super) fn handshake_pending(&self) -> bool {
        self.handshake_sent < self.handshake_out.len()
    }

    /// Whether the handshake is under way (a key is set, not yet done).
    pub(super) fn handshaking(&self) -> bool {
        matches!(self.link, Link::Client(_) | Link::Server | Link::Answered(_))
    }
}

/// A non-blocking connection to `remote` leaving from `local` (a rail's
/// interface): bound first, then connected.
/// Waits for the tags still being made for `stream`'s frames (their tag
/// threads read the frames' bytes).
pub(super) fn settle(stream: &Stream) {
    for frame in &stream.queue {
        if let Some(later) = &frame.later {
            later.wait();
        }
    }
}

/// Tags for the frames about to go on an authenticated connection, in the
/// order they go (a few MiB ahead at most); a large payload's are made on
/// the tag threads while the connection sends what is ready.
/// Returns how many frames' tags went to the tag threads.
pub(super) fn seal_ahead(stream: &mut Stream, later: bool) -> u64 {
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

pub(super) fn connect_from(local: std::net::IpAddr, remote: SocketAddr) -> std::io::Result<TcpStream> {
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
pub(super) fn socket_address(address: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
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

impl TcpTransport {
    pub(super) fn free_token(&mut self) -> usize {
        if let Some(free) = self.streams.iter().position(Option::is_none) {
            return free;
        }
        self.streams.push(None);
        self.streams.len() - 1
    }

    /// A connection may carry frames (up, and authenticated where a key
    /// is set): an outbound one's next break waits the base time, and the
    /// transfers waiting for a connection go.
    pub(super) fn on_connected(&mut self, token: usize) {
        let Some(stream) = self.streams[token].as_mut() else { return };
        stream.connected = true;
        let outbound = stream.peer.is_some();
        if outbound && self.config.features != 0 {
            // What this end speaks, first on the connection; until the
            // answer, it sends only what every build reads.
            let offer = Features(self.config.features).encode();
            let header = FrameHeader::negotiate(FEATURES_LEN);
            let _ = self.queue_negotiation(token, header, &offer, Some(Offered::Features));
        }
        let Some(stream) = self.streams[token].as_mut() else { return };
        if let Some((peer, index)) = stream.peer {
            if let Some(p) = self.peers.get_mut(peer.0 as usize) {
                p.retry_at[index].1 = self.config.reconnect_ns;
            }
            self.feed(peer);
        }
    }

    pub(super) fn accept(&mut self) -> bool {
        let mut accepted = false;
        loop {
            let Some(listener) = self.listener.as_ref() else { return accepted };
            match listener.accept() {
                Ok((mut socket, from)) => {
                    let inbound = self.streams.iter().flatten().filter(|s| s.peer.is_none()).count();
                    if inbound >= self.config.inbound_max {
                        self.stats.inbound_over_cap += 1;
                        // Said at the 1st, 2nd, 4th, ...: a flood is seen,
                        // not logged a line a connection.
                        let shed = self.stats.inbound_over_cap;
                        if shed.is_power_of_two() {
                            let held = self.config.inbound_max;
                            self.note(format!(
                                "connection with {from}: closed, {held} inbound held ({shed} closed so)"
                            ));
                        }
                        continue;
                    }
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
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => {
                    self.stats.accept_failed += 1;
                    return accepted;
                }
            }
        }
    }

    /// A connection is gone. Each transfer that had a slice on it is sent
    /// again, whole, over the peer's other connections (at most
    /// [`ATTEMPTS_MAX`] sendings), or fails; an outbound connection is
    /// tried again later. Blocks landing here through it wait for their
    /// sender's next attempt, or their deadline.
    pub(super) fn lose(&mut self, token: usize, why: &str) {
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
}
