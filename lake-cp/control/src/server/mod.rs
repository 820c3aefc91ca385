//! The control plane's end of the cp↔dp protocol: a mio event loop on a
//! Unix socket that `lake-dp`s connect to, speaking the v1 wire format.
//!
//! Each connection starts with the hello exchange (a `Hello` from the
//! `lake-dp`, answered with `HelloAck` naming the common version and frame
//! limit); then every frame is decoded as it completes and handed to the
//! [`Node`]. A malformed frame — bad magic, CRC, version, kind, length or
//! field — gets an `Error` frame naming what was wrong, and that one
//! connection is closed once the error is sent; every other connection,
//! and everything already applied, is untouched. A report the node
//! refuses (a stale epoch, say) is answered with an `Error` frame and the
//! connection stays up. Buffers are bounded: a peer that sends more than a
//! frame's worth without completing one, or does not read its replies, is
//! closed.
//!
//! The loop is a value the embedder drives (`poll_once`), like the data
//! plane's poller; it owns no thread.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use lake_dp::wire::hello::{self, HELLO_WIRE_VERSION, Identity};
use lake_dp::wire::message::{ErrorBody, ErrorCode, LeaseEntry, LeaseGrant, Role, text_field};
use lake_dp::wire::{FLAG_REPLY, FrameMeta, Limits, Message, Records, WireError, decode_frame, encode_frame};
use mio::net::{UnixListener, UnixStream};
use mio::{Events, Interest, Poll, Token};

use crate::node::{Node, NodeError};
use crate::tier::{TierAction, TierCommand};

mod listeners;

pub(crate) use listeners::{read_available, write_pending};

pub use listeners::{ACCEPT_PAUSE, ADMIN_IDLE, ConnectionCaps, HELLO_DEADLINE, HTTP_DEADLINE, Listener, Shed};

/// A client of the operator's socket ([`crate::admin`]).
struct AdminClient {
    stream: UnixStream,
    input: Vec<u8>,
    output: Vec<u8>,
    /// Close once the output is written (a line too long).
    closing: bool,
    /// When it last sent or was sent anything.
    last: std::time::Instant,
}

/// A client of the metrics endpoint.
struct HttpClient {
    stream: mio::net::TcpStream,
    input: Vec<u8>,
    output: Vec<u8>,
    written: usize,
    /// When it connected.
    since: std::time::Instant,
}

/// Replies queued for one peer beyond which it is closed as not reading.
const OUT_BYTES_MAX: usize = 4 << 20;

/// The uplink's socket in the poll (connections count up from 2; the
/// admin socket is `usize::MAX`).
const UPLINK: Token = Token(usize::MAX - 1);

/// Where a connection is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// Waiting for the peer's hello.
    Hello,
    /// Exchanging messages under these limits.
    Open(Limits),
    /// An error was queued; close once it is written.
    Closing,
}

struct Peer {
    stream: UnixStream,
    session: Session,
    output: Vec<u8>,
    /// When it connected.
    since: std::time::Instant,
}

/// One connection's protocol state, apart from its socket: received bytes
/// go in, complete frames are applied to the node, reply frames come out.
/// The server drives one per connection; the fuzz target drives it with
/// raw bytes.
#[derive(Debug)]
pub struct Session {
    input: Vec<u8>,
    stage: Stage,
    name: String,
    role: Option<Role>,
    peer: u64,
    /// Regions this peer registered (commands for them go to it).
    regions: Vec<u16>,
    /// The feature bits both sides offered at hello.
    features: u64,
    /// The node and process id the peer's hello named.
    node: u32,
    pid: u32,
}

/// Whether a session goes on after a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    /// Keep the connection.
    Open,
    /// Send what was queued, then close.
    Close,
}

impl Session {
    /// Connection `peer` (an id unique in the server), before its hello.
    pub fn new(peer: u64) -> Self {
        Self {
            input: Vec::new(),
            stage: Stage::Hello,
            name: String::new(),
            role: None,
            peer,
            regions: Vec::new(),
            features: 0,
            node: 0,
            pid: 0,
        }
    }

    /// Whether the peer offered `feature` (a `lake_dp::wire::FEATURE_*`
    /// bit) at hello, as this build does.
    pub fn takes(&self, feature: u64) -> bool {
        self.features & feature == feature
    }

    /// The regions this peer registered.
    pub fn regions(&self) -> &[u16] {
        &self.regions
    }

    /// The wire version agreed at hello, once open.
    pub fn version(&self) -> Option<u16> {
        match self.stage {
            Stage::Open(limits) => Some(limits.version_max),
            _ => None,
        }
    }

    /// The peer's role, after its hello.
    pub fn role(&self) -> Option<Role> {
        self.role
    }

    /// The peer's name from its hello (empty before).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The node and process id the peer's hello named (0 before).
    pub fn origin(&self) -> (u32, u32) {
        (self.node, self.pid)
    }

    /// Bytes received and not yet a whole frame.
    pub fn buffered(&self) -> usize {
        self.input.len()
    }

    /// Takes `bytes` received; applies every complete frame to `node`
    /// (answering the hello, and refusals, into `out`). After `Close`
    /// nothing more is applied.
    pub fn feed(&mut self, bytes: &[u8], ctx: &mut Context<'_>, out: &mut Vec<u8>) -> Flow {
        if self.stage == Stage::Closing {
            return Flow::Close;
        }
        self.input.extend_from_slice(bytes);
        loop {
            let limits = match self.stage {
                Stage::Hello => Limits::default(),
                Stage::Open(limits) => limits,
                Stage::Closing => return Flow::Close,
            };
            let (used, outcome) = match decode_frame(&self.input, &limits) {
                Err(WireError::Incomplete { .. }) => {
                    // More than a frame's worth without one completing is
                    // refused by the decoder's size check before this.
                    return Flow::Open;
                }
                Err(e) => (0, Err(Refusal::Frame(e.to_string()))),
                Ok(frame) => {
                    let used = frame.len();
                    let request = frame.header.request_id;
                    let outcome = match (self.stage, &frame.message) {
                        (Stage::Hello, Message::Hello(remote)) => match Role::from_u8(remote.role) {
                            Some(role @ (Role::DataPlane | Role::Agent)) => {
                                hello::accept(ctx.local_hello, remote, ctx.term)
                                    .and_then(|ack| hello::limits_after(&ack).map(|limits| (ack, limits)))
                                    .map(|(ack, limits)| {
                                        self.stage = Stage::Open(limits);
                                        self.features = ack.features;
                                        (self.node, self.pid) = (remote.node, remote.pid);
                                        self.name = remote.name().to_owned();
                                        self.role = Some(role);
                                        Some(Reply::Fixed(request, Message::HelloAck(ack), HELLO_WIRE_VERSION))
                                    })
                                    .map_err(|e| Refusal::Frame(e.to_string()))
                            }
                            _ => Err(Refusal::Frame("hello: only lake-dp and agents connect here".to_owned())),
                        },
                        (Stage::Hello, _) => Err(Refusal::Frame("the first frame must be a hello".to_owned())),
                        (Stage::Open(limits), message) if self.role == Some(Role::Agent) => {
                            match ctx.node.on_agent(self.peer, request, message, ctx.now_ns) {
                                Ok(Some(lease)) => {
                                    Ok(Some(Reply::Lease(request, lease_reply(lease), limits.version_max)))
                                }
                                Ok(None) => Ok(None),
                                Err(e) => Err(Refusal::Report(request, e, limits.version_max)),
                            }
                        }
                        (Stage::Open(limits), message) => match ctx.node.on_data_plane(request, message) {
                            Ok(()) => {
                                if let Message::RegisterRegion(region) = message {
                                    if !self.regions.contains(&region.region) {
                                        self.regions.push(region.region);
                                    }
                                    if region.tier == lake_dp::Tier::L1Dram as u8
                                        && self.takes(lake_dp::wire::FEATURE_EVICTABLE)
                                    {
                                        ctx.node.tiers.takes_marks(region.region);
                                    }
                                }
                                Ok(None)
                            }
                            Err(e) => Err(Refusal::Report(request, e, limits.version_max)),
                        },
                        (Stage::Closing, _) => Ok(None),
                    };
                    (used, outcome)
                }
            };
            match outcome {
                Ok(reply) => {
                    self.input.drain(..used);
                    ctx.counters.frames += 1;
                    match reply {
                        Some(Reply::Fixed(request, message, version)) => {
                            encode_into(out, request, &message, version, ctx.term);
                        }
                        Some(Reply::Lease(request, (head, entries), version)) => {
                            let message = Message::LeaseGrant(head, Records::from_slice(&entries));
                            encode_into(out, request, &message, version, ctx.term);
                        }
                        None => {}
                    }
                }
                Err(Refusal::Report(request, error, version)) => {
                    self.input.drain(..used);
                    ctx.counters.refused += 1;
                    let body = error_body(code_of(&error), request, &error.to_string());
                    encode_into(out, request, &Message::Error(body), version, ctx.term);
                }
                Err(Refusal::Frame(detail)) => {
                    ctx.counters.bad_frames += 1;
                    let body = error_body(ErrorCode::BadFrame, 0, &detail);
                    encode_into(out, 0, &Message::Error(body), HELLO_WIRE_VERSION, ctx.term);
                    self.stage = Stage::Closing;
                    self.input.clear();
                    return Flow::Close;
                }
            }
        }
    }
}

/// What a session works on: the node, the local hello, the term, counters.
#[derive(Debug)]
pub struct Context<'a> {
    /// The node authority.
    pub node: &'a mut Node,
    /// This side's hello.
    pub local_hello: &'a lake_dp::wire::message::Hello,
    /// The leader term acted under.
    pub term: u64,
    /// Wall-clock time (Unix ns), for lease deadlines.
    pub now_ns: u64,
    /// Counters to bump.
    pub counters: &'a mut ServerCounters,
}

/// A reply to a frame.
enum Reply<'a> {
    /// A fixed message.
    Fixed(u64, Message<'a>, u16),
    /// A lease grant: head and entries.
    Lease(u64, (LeaseGrant, Vec<LeaseEntry>), u16),
}

fn lease_reply(lease: &crate::lease::Lease) -> (LeaseGrant, Vec<LeaseEntry>) {
    let entries: Vec<LeaseEntry> =
        lease.entries.iter().map(|(key, replica)| LeaseEntry { key: *key, replica: replica.to_wire() }).collect();
    let head = LeaseGrant {
        lease_id: lease.id,
        deadline_unix_ns: lease.deadline_ns,
        count: u32::try_from(entries.len()).unwrap_or(u32::MAX),
        reserved: 0,
    };
    (head, entries)
}

/// Appends one reply frame to `out`.
fn encode_into(out: &mut Vec<u8>, request: u64, message: &Message<'_>, version: u16, term: u64) {
    let meta = FrameMeta { version, flags: FLAG_REPLY, request_id: request, leader_term: term };
    // A frame this side builds encodes, or is left out (nothing appended).
    let _ = lake_dp::wire::append_frame(out, meta, message);
}

/// What a node serves beside its cp socket ([`Server::serve_beside`]), as
/// its settings say (`lake serve`'s, or the file a `lake cp` is given).
#[derive(Clone, Debug)]
pub struct Beside {
    /// The socket's group and mode, and who may connect.
    pub access: (Option<u32>, u32, lake_dp::auth::PeerPolicy),
    /// Connections each listener holds at once.
    pub caps: ConnectionCaps,
    /// The operator's socket, if any.
    pub admin: Option<PathBuf>,
    /// Where `/metrics`, `/healthz` and `/readyz` are served, if anywhere.
    pub metrics: Option<std::net::SocketAddr>,
}

/// What the server has seen, for metrics and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServerCounters {
    /// Connections accepted.
    pub accepted: u64,
    /// Connections closed (by either side).
    pub closed: u64,
    /// Frames applied.
    pub frames: u64,
    /// Connections closed for a malformed frame or a bad hello.
    pub bad_frames: u64,
    /// Reports the node refused (connection kept).
    pub refused: u64,
    /// Tier commands sent to data planes.
    pub commands: u64,
    /// Connections refused for their peer's credentials (not on the
    /// allow-list).
    pub strangers: u64,
    /// Connections each listener let go, in [`Listener::ALL`]'s order.
    pub shed: [Shed; 3],
}

/// The cp↔dp server. See the module docs.
pub struct Server {
    poll: Poll,
    events: Events,
    listener: UnixListener,
    path: PathBuf,
    peers: HashMap<Token, Peer>,
    /// Who may connect to the socket.
    policy: lake_dp::auth::PeerPolicy,
    /// Connections refused and why, for the log.
    refusals: Vec<String>,
    metrics: Option<mio::net::TcpListener>,
    http: HashMap<Token, HttpClient>,
    /// The operator's socket and its clients.
    admin: Option<(UnixListener, PathBuf)>,
    admin_clients: HashMap<Token, AdminClient>,
    next_token: usize,
    /// The listeners' caps and rests.
    gate: listeners::Gate,
    node: Node,
    local_hello: lake_dp::wire::message::Hello,
    term: u64,
    commands: Vec<TierCommand>,
    /// The link to the leader's summary, if this node reports to one.
    uplink: Option<crate::summary::link::Uplink>,
    /// Which of the uplink's connections the poll watches (its count of
    /// connects), so the leader's messages wake the loop.
    uplink_watched: Option<u64>,
    changes: Vec<crate::location::Change>,
    /// What it has seen.
    pub counters: ServerCounters,
}

impl core::fmt::Debug for Server {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Server").field("path", &self.path).field("peers", &self.peers.len()).finish_non_exhaustive()
    }
}

impl Server {
    /// Listens on the Unix socket `path` (a stale socket file is replaced;
    /// anything else there is refused) for `node`, acting under leader
    /// `term`.
    pub fn bind(path: &Path, node: Node, term: u64) -> io::Result<Self> {
        lake_dp::auth::peer::clear_stale_socket(path)?;
        let mut listener = UnixListener::bind(path)?;
        let poll = Poll::new()?;
        poll.registry().register(&mut listener, Listener::Cp.token(), Interest::READABLE)?;
        let identity = Identity {
            role: Role::ControlPlane,
            node: node.node().0,
            pid: std::process::id(),
            region_epoch: 0,
            features: lake_dp::wire::FEATURES,
            name: "lake-cp",
        };
        let local_hello =
            hello::hello(&identity).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        Ok(Self {
            poll,
            events: Events::with_capacity(256),
            listener,
            path: path.to_path_buf(),
            peers: HashMap::new(),
            policy: lake_dp::auth::PeerPolicy::own_user(),
            refusals: Vec::new(),
            metrics: None,
            http: HashMap::new(),
            admin: None,
            admin_clients: HashMap::new(),
            next_token: 2,
            gate: listeners::Gate::default(),
            node,
            local_hello,
            term,
            commands: Vec::new(),
            uplink: None,
            uplink_watched: None,
            changes: Vec::new(),
            counters: ServerCounters::default(),
        })
    }

    /// Who may connect (checked on the peer's credentials as the kernel
    /// gives them; by default this process's user and root), and the
    /// socket file's mode and group.
    pub fn restrict(&mut self, policy: lake_dp::auth::PeerPolicy, mode: u32, gid: Option<u32>) -> io::Result<()> {
        lake_dp::auth::peer::restrict(&self.path, mode, gid)?;
        self.policy = policy;
        Ok(())
    }

    /// Connections refused since the last call and why (for the log).
    pub fn take_refusals(&mut self) -> Vec<String> {
        core::mem::take(&mut self.refusals)
    }

    /// Serves `GET /metrics` (Prometheus text) and `GET /healthz` on
    /// `address` from this loop. Returns the bound address (port 0 picks
    /// one).
    pub fn serve_metrics(&mut self, address: std::net::SocketAddr) -> io::Result<std::net::SocketAddr> {
        self.serve_metrics_on(std::net::TcpListener::bind(address)?)
    }

    /// [`Server::serve_metrics`] on a listener bound already (a standby's,
    /// which answered health checks until it led); connections it has
    /// not accepted yet are served too.
    pub fn serve_metrics_on(&mut self, listener: std::net::TcpListener) -> io::Result<std::net::SocketAddr> {
        listener.set_nonblocking(true)?;
        let mut listener = mio::net::TcpListener::from_std(listener);
        self.poll.registry().register(&mut listener, Listener::Metrics.token(), Interest::READABLE)?;
        let bound = listener.local_addr()?;
        self.metrics = Some(listener);
        Ok(bound)
    }

    /// Serves beside the cp socket what a node's settings ask (see
    /// [`Beside`]). Returns the address `/metrics` is served at; an error
    /// names what could not be served.
    pub fn serve_beside(&mut self, beside: &Beside) -> Result<Option<std::net::SocketAddr>, (String, io::Error)> {
        let (gid, mode, policy) = beside.access.clone();
        self.set_caps(beside.caps);
        self.restrict(policy, mode, gid).map_err(|e| (format!("{}: mode and group", self.path.display()), e))?;
        if let Some(admin) = &beside.admin {
            self.serve_admin(admin).map_err(|e| (admin.display().to_string(), e))?;
        }
        beside.metrics.map(|at| self.serve_metrics(at).map_err(|e| (format!("metrics on {at}"), e))).transpose()
    }

    /// Serves the operator's socket ([`crate::admin`]) at `path` (a stale
    /// socket is replaced; anything else there is refused) from this
    /// loop: mode 0600, this user and root only.
    pub fn serve_admin(&mut self, path: &Path) -> io::Result<()> {
        lake_dp::auth::peer::clear_stale_socket(path)?;
        let mut listener = UnixListener::bind(path)?;
        lake_dp::auth::peer::restrict(path, 0o600, None)?;
        self.poll.registry().register(&mut listener, Listener::Admin.token(), Interest::READABLE)?;
        self.admin = Some((listener, path.to_path_buf()));
        Ok(())
    }

    /// Reports this node's replicas to the leader's summary at whichever
    /// of `leaders` accepts (see [`crate::summary::link`]).
    /// With `key`, the link is authenticated (the leader must hold it too).
    /// With `views`, it keeps the cluster view the leader streams back,
    /// each tenant's blocks in its tenant's view alone. It says to the
    /// leader which tenants it keeps apart (`kept_apart`: each one's name
    /// and namespaces; [`crate::summary::apart`]).
    pub fn report_to(
        &mut self,
        leaders: Vec<std::net::SocketAddr>,
        key: Option<lake_dp::auth::LinkKey>,
        views: Option<crate::summary::link::NodeViews>,
        kept_apart: &[(String, Vec<u64>)],
    ) {
        let mut uplink = crate::summary::link::Uplink::new(self.node.node().0, leaders).with_kept_apart(kept_apart);
        if let Some(key) = key {
            uplink = uplink.authenticated(key);
        }
        if let Some(views) = views {
            uplink = uplink.with_view(views.pool).with_tenant_views(views.tenants);
        }
        self.uplink = Some(uplink);
    }

    /// The link to the leader's summary, if any.
    pub fn uplink(&self) -> Option<&crate::summary::link::Uplink> {
        self.uplink.as_ref()
    }

    /// The node authority.
    pub fn node(&self) -> &Node {
        &self.node
    }

    /// The node authority, to change (tests, the embedded pool).
    pub fn node_mut(&mut self) -> &mut Node {
        &mut self.node
    }

    /// This side's hello (for driving a [`Session`] by hand).
    pub fn local_hello(&self) -> &lake_dp::wire::message::Hello {
        &self.local_hello
    }

    /// Connections open.
    pub fn peers(&self) -> usize {
        self.peers.len()
    }

    /// One pass: accepts, reads and applies whatever is ready, writes what
    /// is queued; waits at most `timeout` for something to happen, and no
    /// longer than the node's next copy to ask again is due.
    pub fn poll_once(&mut self, timeout: Option<Duration>) -> io::Result<()> {
        let due = self.node.copy_again_due().map(|at| Duration::from_nanos(at.saturating_sub(unix_ns())));
        let timeout = timeout.into_iter().chain(due).min();
        match self.poll.poll(&mut self.events, timeout) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return Ok(()),
            Err(e) => return Err(e),
        }
        self.node.leases.reap(unix_ns());
        let ready: Vec<(Token, bool, bool)> =
            self.events.iter().map(|e| (e.token(), e.is_readable() || e.is_read_closed(), e.is_writable())).collect();
        for (token, readable, writable) in ready {
            if token == UPLINK {
                // Read with the uplink's pass below.
                continue;
            }
            if let Some(listener) = Listener::of(token) {
                self.accept_on(listener);
                continue;
            }
            if self.http.contains_key(&token) {
                self.serve_http(token);
                continue;
            }
            if self.admin_clients.contains_key(&token) {
                self.serve_admin_client(token);
                continue;
            }
            if readable {
                self.read(token);
            }
            if writable {
                self.flush(token);
            }
        }
        self.sweep();
        self.send_commands();
        self.node.wake_readers();
        // The location view's changes go to the leader's summary, or away.
        self.changes.clear();
        self.node.take_changes(&mut self.changes);
        self.pump_uplink();
        self.watch_uplink();
        Ok(())
    }

    /// The link to the leader's summary: this pass's changes and the
    /// engines' pulls up, the copies the leader asked carried out.
    fn pump_uplink(&mut self) {
        // Engines' pulls go to the leader, to be asked of their holders; a
        // node reporting to no summary has none to ask (the engines,
        // waiting, find the blocks missing).
        let pulls = self.node.take_pulls();
        let relayed = match &mut self.uplink {
            Some(uplink) => pulls.iter().filter(|pull| uplink.pull(pull)).count(),
            None => 0,
        };
        self.counters.refused += (pulls.len() - relayed) as u64;
        if let Some(uplink) = &mut self.uplink {
            // Victims with no room here, offered to the pool.
            let node = self.node.node();
            for key in self.node.tiers.take_spills() {
                let source =
                    self.node.locations.ready(&key).find(|r| r.tier == lake_dp::Tier::L1Dram && r.node == node);
                if !source.is_some_and(|source| uplink.spill(&key, source.to_wire())) {
                    self.node.tiers.spill_done(&key, false);
                }
            }
            uplink.pump(&self.node.locations, &self.changes);
            self.node.pulls_move = uplink.pulls_move();
            self.node.tiers.set_spills(uplink.spills());
            // Replication the leader asked: copies of this node's L1
            // blocks into other nodes' L1, sent with the next plan.
            let copies = uplink.take_copies();
            for transfer in &copies {
                let priority = lake_dp::Priority::from_u8(transfer.priority).unwrap_or(lake_dp::Priority::Replication);
                if priority == lake_dp::Priority::WriteBack && transfer.target.node == node.0 {
                    // A spill no member has room for.
                    self.node.tiers.spill_done(&transfer.key, false);
                    continue;
                }
                if priority == lake_dp::Priority::CriticalLoad && !self.node.pulls_move {
                    // A pull that leaves the block here: another node
                    // reads it, and this copy is the one the pool keeps.
                    self.node.tiers.read_remotely(&transfer.key);
                }
                // A write-back: the pool places a block saved here in its
                // home.
                let asked = if priority == lake_dp::Priority::WriteBack {
                    self.node.place_to(&transfer.key, transfer.target)
                } else {
                    self.node.copy_to(&transfer.key, transfer.target, priority)
                };
                if asked.is_err() {
                    self.counters.refused += 1;
                }
            }
            if !copies.is_empty() {
                // A pull waits on them: sent now, not on the next pass.
                self.send_commands();
            }
        }
    }

    /// Puts the uplink's socket in the poll, once a connection: the
    /// leader's asks (a pull's copy) wake the loop rather than wait for
    /// its timeout. A closed socket leaves the poll by itself.
    fn watch_uplink(&mut self) {
        let Some((fd, connection)) = self.uplink.as_ref().and_then(crate::summary::link::Uplink::socket) else {
            self.uplink_watched = None;
            return;
        };
        if self.uplink_watched == Some(connection) {
            return;
        }
        let registry = self.poll.registry();
        let mut source = mio::unix::SourceFd(&fd);
        let watched = registry
            .register(&mut source, UPLINK, Interest::READABLE)
            .or_else(|_| registry.reregister(&mut source, UPLINK, Interest::READABLE));
        if watched.is_ok() {
            self.uplink_watched = Some(connection);
        }
    }

    /// Plans tier moves and sends each to the `lake-dp` that registered
    /// its region; a command with no such peer fails at once.
    fn send_commands(&mut self) {
        self.commands.clear();
        self.node.plan(unix_ns(), &mut self.commands);
        if self.commands.is_empty() {
            return;
        }
        let mut touched = Vec::new();
        for command in &self.commands {
            let peer = self
                .peers
                .iter_mut()
                .find(|(_, p)| p.session.role == Some(Role::DataPlane) && p.session.regions.contains(&command.region));
            let Some((&token, peer)) = peer.and_then(|(t, p)| p.session.version().map(|_| (t, p))) else {
                self.node.tiers.unrouted(command.request);
                continue;
            };
            let version = peer.session.version().unwrap_or(HELLO_WIRE_VERSION);
            match command.action {
                // A data plane built before drains would close the link
                // on the kind: it is told nothing, and the drain fails.
                TierAction::Drain(_) if !peer.session.takes(lake_dp::wire::FEATURE_DRAIN) => {
                    self.node.tiers.drain_refused(command.region, "its lake-dp does not drain (an older build)");
                    self.node.tiers.unrouted(command.request);
                    continue;
                }
                // Only a data plane that offered marks is sent any (the
                // manager marks only its regions).
                TierAction::Mark(_) | TierAction::Unmark(_)
                    if !peer.session.takes(lake_dp::wire::FEATURE_EVICTABLE) =>
                {
                    continue;
                }
                TierAction::VictimsLeft(_) if !peer.session.takes(lake_dp::wire::FEATURE_VICTIMS_LEFT) => continue,
                // A `Cancel` is kind 10, in wire v1 from the start: a data
                // plane built before it took copies back ignores it.
                _ => {}
            }
            let message = command.action.message(command.request);
            let meta = FrameMeta { version, flags: 0, request_id: command.request, leader_term: self.term };
            let start = peer.output.len();
            peer.output.resize(start + 256, 0);
            match encode_frame(meta, &message, &mut peer.output[start..]) {
                Ok(len) => peer.output.truncate(start + len),
                Err(_) => {
                    peer.output.truncate(start);
                    self.node.tiers.unrouted(command.request);
                    continue;
                }
            }
            self.counters.commands += 1;
            if !touched.contains(&token) {
                touched.push(token);
            }
        }
        for token in touched {
            self.flush(token);
        }
    }

    fn read(&mut self, token: Token) {
        let Some(peer) = self.peers.get_mut(&token) else { return };
        let mut ctx = Context {
            node: &mut self.node,
            local_hello: &self.local_hello,
            term: self.term,
            now_ns: unix_ns(),
            counters: &mut self.counters,
        };
        let mut chunk = [0u8; 64 * 1024];
        let mut flow = Flow::Open;
        let mut eof = false;
        loop {
            match peer.stream.read(&mut chunk) {
                Ok(0) => {
                    eof = true;
                    break;
                }
                Ok(n) => {
                    flow = peer.session.feed(&chunk[..n], &mut ctx, &mut peer.output);
                    if flow == Flow::Close {
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => {
                    eof = true;
                    break;
                }
            }
        }
        if peer.output.len() > OUT_BYTES_MAX {
            // Not reading its replies: it goes.
            flow = Flow::Close;
            peer.output.clear();
        }
        if eof {
            self.close(token);
            return;
        }
        self.flush(token);
        if flow == Flow::Close {
            let done = self.peers.get(&token).is_none_or(|peer| peer.output.is_empty());
            if done {
                self.close(token);
            } else if let Some(peer) = self.peers.get_mut(&token) {
                peer.session.stage = Stage::Closing;
            }
        }
    }

    fn flush(&mut self, token: Token) {
        let mut gone = false;
        if let Some(peer) = self.peers.get_mut(&token) {
            while !peer.output.is_empty() {
                match peer.stream.write(&peer.output) {
                    Ok(0) => {
                        gone = true;
                        break;
                    }
                    Ok(n) => {
                        peer.output.drain(..n);
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => {
                        gone = true;
                        break;
                    }
                }
            }
            if peer.session.stage == Stage::Closing && peer.output.is_empty() {
                gone = true;
            }
        }
        if gone {
            self.close(token);
        }
    }

    fn close(&mut self, token: Token) {
        if let Some(mut peer) = self.peers.remove(&token) {
            // An agent's leases end with its connection; a data plane's
            // commands in flight are given up.
            self.node.leases.release_peer(peer.session.peer);
            self.node.l0.engine_gone(peer.session.peer);
            self.node.engine_rails.retain(|(p, _)| *p != peer.session.peer);
            self.node.engine_gone(peer.session.peer);
            self.node.tiers.lost_regions(&peer.session.regions);
            let _ = self.poll.registry().deregister(&mut peer.stream);
            self.counters.closed += 1;
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
        if let Some((_, path)) = &self.admin {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Wall-clock now, in Unix ns.
fn unix_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

enum Refusal {
    /// The stream is corrupt (or the hello failed): error, then close.
    Frame(String),
    /// A well-formed report the node refused: error, connection kept.
    Report(u64, NodeError, u16),
}

fn code_of(error: &NodeError) -> ErrorCode {
    use crate::location::LocationError;
    match error {
        NodeError::Location(LocationError::StaleEpoch) => ErrorCode::StaleEpoch,
        NodeError::Location(LocationError::StaleGeneration) => ErrorCode::StaleGeneration,
        NodeError::Location(LocationError::NoReservation | LocationError::UnknownRegion) => ErrorCode::NoSuchBlock,
        NodeError::Location(_) => ErrorCode::Internal,
        NodeError::Unexpected(_) | NodeError::Field(_) => ErrorCode::BadFrame,
    }
}

fn error_body(code: ErrorCode, request: u64, detail: &str) -> ErrorBody {
    // The detail field holds 48 bytes: cut at a character boundary.
    let mut end = detail.len().min(48);
    while !detail.is_char_boundary(end) {
        end -= 1;
    }
    ErrorBody {
        code: code as u32,
        reserved: 0,
        failed_request: request,
        detail: text_field("error.detail", &detail[..end]).unwrap_or([0; 48]),
    }
}

impl TierAction {
    /// The frame that asks it of a data plane, under `request` (the
    /// command's id, which a `Cancel` names).
    pub fn message(self, request: u64) -> lake_dp::wire::Message<'static> {
        use lake_dp::wire::Message;
        match self {
            Self::Move(transfer) => Message::MoveBlock(transfer),
            Self::Copy(transfer) => Message::CopyBlock(transfer),
            Self::Evict(evict) => Message::EvictBlock(evict),
            Self::Drain(drain) => Message::DrainRegion(drain),
            Self::Cancel => Message::Cancel(lake_dp::wire::message::Cancel { request_id: request }),
            Self::Mark(victim) => Message::MarkEvictable(victim),
            Self::Unmark(victim) => Message::UnmarkEvictable(victim),
            Self::VictimsLeft(left) => Message::VictimsLeft(left),
        }
    }
}
