//! The summary's wire: each node's `lake-cp` streams its location view's
//! numbered changes to the leader over TCP ([`Uplink`]); the leader applies
//! them to its [`Summary`] and asks for a snapshot where it finds a gap
//! ([`Aggregator`]).
//!
//! ```text
//! node lake-cp ── Hello ─────────────────────────────▶ leader
//!              ── Snapshot × n (its ready replicas) ─▶   (every connect)
//!              ── Delta (term, sequence, changes) ───▶   applied in order
//!              ◀── SnapshotRequest (gap seen) ────────
//!              ◀── ViewSnapshot × n (every connect) ──  the cluster view,
//!              ◀── ViewDelta (term, sequence, node) ──  where the node
//!              ── SnapshotRequest (view gap seen) ───▶   offered it
//! ```
//!
//! The cluster view flows back down the same connection to each node
//! whose hello offered [`FEATURE_CLUSTER_VIEW`]: every block each node
//! holds, with its fastest tier offered to readers ([`ViewEntry`]),
//! numbered by the leader's term and a sequence per frame. The node
//! publishes it beside its mirror ([`ViewWriter`]) for its engines. A node
//! that sees a gap asks for a view snapshot; a node whose connection the
//! leader finds too far behind is sent no more deltas but a snapshot once
//! it has caught up, so the leader holds at most one snapshot and
//! [`VIEW_BEHIND_MAX`] for it.
//!
//! Frames are the wire v1 format of every other link (CRC'd, checked).
//! With the cluster's link key set on both ends ([`Uplink::authenticated`],
//! [`Aggregator::authenticate`]) the connection opens with the handshake
//! of [`lake_dp::auth`] and every frame travels in a tagged record: a
//! connection that fails its handshake or a record's tag is closed, and
//! said so ([`Aggregator::take_security_events`]).
//! Neither side blocks: the uplink is pumped from the node's loop, the
//! aggregator from the leader's. A node whose link is down drops its
//! changes (counted) and sends a snapshot when it is back, so what the
//! leader misses is bounded by one snapshot, never by a queue.

use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use lake_dp::auth::{AuthError, LinkKey, RecordLink};
use lake_dp::constants::DELTA_ENTRIES_MAX;
use lake_dp::mirror::view::ViewWriter;
use lake_dp::wire::hello::{self, HELLO_WIRE_VERSION, Identity};
use lake_dp::wire::message::{Delta, DeltaEntry, Records, Role, SLOT_ANY, SnapshotRequest};
use lake_dp::wire::{
    FEATURE_CLUSTER_VIEW, FEATURE_PULLS_MOVE, FEATURE_SPILLS, FEATURE_VIEW_NAMESPACES, FLAG_REPLY, FrameMeta, Limits,
    Message, WireError, append_frame, decode_frame,
};
use lake_dp::{BlockKey, Tier};

use super::conn::Wire;
pub use super::report::{deltas, entry_of, snapshot};
pub use super::view::NodeViews;
use super::view::{ViewCopy, append_view_frame, unnamed, view_snapshot};
pub use super::{AggregatorCounters, UplinkCounters};
use super::{Outcome, Replication, Summary};
use crate::location::{Change, Locations};

/// A connection's output past this is cut (the peer does not read): the
/// node reconnects and sends a snapshot. A view snapshot queued for it
/// counts apart.
const OUTPUT_MAX: usize = 64 << 20;

/// Pulls the aggregator takes in one pass, at most (more are dropped,
/// counted: the engines waiting on them recompute).
const PULLS_MAX: usize = 1 << 16;

/// Keeps a node's pull for the pass's end (at most [`PULLS_MAX`]; more
/// are counted unheld).
fn take_pull(
    pulls: &mut Vec<lake_dp::wire::message::Transfer>,
    unheld: &mut u64,
    pull: lake_dp::wire::message::Transfer,
) {
    if pulls.len() < PULLS_MAX {
        pulls.push(pull);
    } else {
        *unheld += 1;
    }
}

/// Whether `transfer`, from node `from`, is a spill: it names the node
/// itself as source and target (the leader picks where it goes).
fn is_spill(from: Option<u32>, transfer: &lake_dp::wire::message::Transfer) -> bool {
    from == Some(transfer.source.node) && transfer.target.node == transfer.source.node
}

/// Applies a node's delta, or its snapshot's frame (`head`, whether a
/// snapshot), to `summary`: the snapshot to ask it for, where there is a
/// gap.
fn apply_report(
    summary: &mut Summary,
    counters: &mut AggregatorCounters,
    (head, snapshot): (&Delta, bool),
    entries: impl IntoIterator<Item = DeltaEntry>,
) -> Option<SnapshotRequest> {
    let outcome = if snapshot {
        counters.snapshot_frames += 1;
        summary.snapshot(head, entries)
    } else {
        summary.delta(head, entries)
    };
    match outcome {
        Outcome::Applied { .. } => counters.applied += 1,
        Outcome::Stale => counters.stale += 1,
        Outcome::NeedSnapshot { node, term } => {
            counters.gaps += 1;
            return Some(SnapshotRequest { node, reserved: 0, term });
        }
    }
    None
}

/// A node's connection with more than this unsent gets no more view
/// deltas: a view snapshot once it has caught up instead.
pub const VIEW_BEHIND_MAX: usize = 16 << 20;

pub(super) fn meta(request_id: u64) -> FrameMeta {
    FrameMeta { version: HELLO_WIRE_VERSION, flags: 0, request_id, leader_term: 0 }
}

/// Bytes a record of the link carries at most (a snapshot frame of
/// [`DELTA_ENTRIES_MAX`] entries is far smaller).
const RECORD_MAX: usize = 16 << 20;

/// Security events an aggregator keeps for its caller, at most.
const SECURITY_EVENTS_MAX: usize = 64;

/// A node's link to the leader's aggregator. See the module docs.
#[derive(Debug)]
pub struct Uplink {
    node: u32,
    leaders: Vec<SocketAddr>,
    next: usize,
    wire: Option<Wire>,
    key: Option<LinkKey>,
    /// Why the last connection was refused, if it was.
    last_refusal: Option<String>,
    snapshot_due: bool,
    /// Copies the leader asked of this node, to hand to its tier
    /// manager ([`Uplink::take_copies`]).
    copies: Vec<lake_dp::wire::message::Transfer>,
    retry_at: Instant,
    wait: Duration,
    request: u64,
    /// The link version its handshakes offer: the latest, until a leader
    /// says it speaks only an older one (a rolling upgrade).
    link_version: u8,
    /// The cluster view it keeps, where it keeps one.
    view: Option<ViewCopy>,
    /// Whether the leader last connected moves pulled blocks to their
    /// readers ([`FEATURE_PULLS_MOVE`] in its ack).
    pulls_move: bool,
    /// Whether the leader last connected places this node's spills
    /// ([`FEATURE_SPILLS`] in its ack).
    spills: bool,
    /// What it has done.
    pub counters: UplinkCounters,
}

impl Uplink {
    /// An uplink for `node` to whichever of `leaders` accepts (tried in
    /// turn; only the leading aggregator listens).
    pub fn new(node: u32, leaders: Vec<SocketAddr>) -> Self {
        Self {
            node,
            leaders,
            next: 0,
            wire: None,
            key: None,
            last_refusal: None,
            snapshot_due: true,
            copies: Vec::new(),
            retry_at: Instant::now(),
            wait: Duration::from_millis(50),
            request: 0,
            link_version: lake_dp::auth::handshake::AUTH_VERSION,
            view: None,
            pulls_move: false,
            spills: false,
            counters: UplinkCounters::default(),
        }
    }

    /// Whether a pull moves the block to its reader: the leader last
    /// connected said so ([`FEATURE_PULLS_MOVE`]). Else the reader's copy
    /// is a copy and the holder's stays.
    pub fn pulls_move(&self) -> bool {
        self.pulls_move
    }

    /// Keeps the leader's cluster view in `writer` (offered in every
    /// hello; the leader streams it back).
    #[must_use]
    pub fn with_view(mut self, writer: ViewWriter) -> Self {
        self.view = Some(ViewCopy {
            writer,
            tenants: Vec::new(),
            term: 0,
            sequence: 0,
            gap: false,
            receiving: None,
            streaming: false,
        });
        self
    }

    /// Shows the blocks of each tenant's namespaces in that tenant's own
    /// view, and only there (with [`Uplink::with_view`], which then shows
    /// only the other namespaces' blocks, and none of no known namespace):
    /// each block's namespace is asked of the leader
    /// ([`FEATURE_VIEW_NAMESPACES`]).
    #[must_use]
    pub fn with_tenant_views(mut self, views: Vec<(Vec<u64>, ViewWriter)>) -> Self {
        if let Some(view) = &mut self.view {
            view.tenants = views;
        }
        self
    }

    /// The socket to the leader, and which connection it is (connects so
    /// far): a node's event loop waits on it for the leader's messages.
    pub fn socket(&self) -> Option<(std::os::fd::RawFd, u64)> {
        use std::os::fd::AsRawFd;
        self.wire.as_ref().map(|wire| (wire.stream.as_raw_fd(), self.counters.connects))
    }

    /// Sends an engine's pull of another node's block into this node's L1
    /// to the leader, which asks the holder for the copy. Only through a
    /// leader streaming the view (one that takes pulls); false where none
    /// is connected (the engine, waiting, finds the block missing).
    pub fn pull(&mut self, transfer: &lake_dp::wire::message::Transfer) -> bool {
        let streaming = self.view.as_ref().is_some_and(|v| v.streaming);
        let Some(wire) = self.wire.as_mut().filter(|_| streaming) else {
            self.counters.pulls_dropped += 1;
            return false;
        };
        if append_frame(&mut wire.output, meta(0), &Message::CopyBlock(*transfer)).is_err() {
            return false;
        }
        self.counters.pulls_sent += 1;
        true
    }

    /// Whether the leader connected now places this node's spills
    /// ([`FEATURE_SPILLS`]): a victim that would be dropped may be offered
    /// ([`Uplink::spill`]).
    pub fn spills(&self) -> bool {
        self.spills && self.wire.is_some()
    }

    /// Offers the leader L1 victim `key` (its `source` replica here) to be
    /// placed in another member with room; false where no leader placing
    /// spills is connected (the block is dropped, as it would have been).
    pub fn spill(&mut self, key: &BlockKey, source: lake_dp::model::replica::ReplicaWire) -> bool {
        let Some(wire) = self.wire.as_mut().filter(|_| self.spills) else {
            self.counters.spills_dropped += 1;
            return false;
        };
        // Source and target both this node: the leader picks the target.
        let target = lake_dp::model::replica::ReplicaWire { slot: SLOT_ANY, generation: 0, ..source };
        let transfer = lake_dp::wire::message::Transfer {
            source,
            target,
            key: *key,
            deadline_unix_ns: 0,
            priority: lake_dp::Priority::WriteBack as u8,
            reserved: [0; 7],
        };
        if append_frame(&mut wire.output, meta(0), &Message::CopyBlock(transfer)).is_err() {
            self.counters.spills_dropped += 1;
            return false;
        }
        self.counters.spills_sent += 1;
        true
    }

    /// The cluster view it keeps: (term, last frame applied, blocks,
    /// nodes named).
    pub fn view_figures(&self) -> Option<(u64, u64, u64, usize)> {
        self.view.as_ref().map(|v| {
            let (blocks, nodes) = v.figures();
            (v.term, v.sequence, blocks, nodes)
        })
    }

    /// Authenticates every connection to the leader with `key`.
    #[must_use]
    pub fn authenticated(mut self, key: LinkKey) -> Self {
        self.key = Some(key);
        self
    }

    /// Whether a leader is connected.
    pub fn is_connected(&self) -> bool {
        self.wire.is_some()
    }

    /// Why the last connection to a leader was refused, if it was.
    pub fn last_refusal(&self) -> Option<&str> {
        self.last_refusal.as_deref()
    }

    fn close(&mut self) {
        self.wire = None;
        // The next leader says anew.
        self.spills = false;
        // The leader may come back upgraded: the next handshake offers the
        // latest again (a refusal naming an older one steps down after).
        self.link_version = lake_dp::auth::handshake::AUTH_VERSION;
        self.snapshot_due = true;
        self.retry_at = Instant::now() + self.wait;
        self.wait = (self.wait * 2).min(Duration::from_secs(1));
    }

    fn connect(&mut self) {
        if self.leaders.is_empty() || Instant::now() < self.retry_at {
            return;
        }
        let address = self.leaders[self.next % self.leaders.len()];
        self.next += 1;
        let Ok(stream) = TcpStream::connect_timeout(&address, Duration::from_millis(200)) else {
            self.retry_at = Instant::now() + self.wait;
            self.wait = (self.wait * 2).min(Duration::from_secs(1));
            return;
        };
        let identity = Identity {
            role: Role::ControlPlane,
            node: self.node,
            pid: std::process::id(),
            region_epoch: 0,
            features: match &self.view {
                None => 0,
                Some(view) if view.tenants.is_empty() => FEATURE_CLUSTER_VIEW | FEATURE_PULLS_MOVE | FEATURE_SPILLS,
                Some(_) => FEATURE_CLUSTER_VIEW | FEATURE_VIEW_NAMESPACES | FEATURE_PULLS_MOVE | FEATURE_SPILLS,
            },
            name: "lake-cp",
        };
        let Ok(local) = hello::hello(&identity) else { return };
        if stream.set_nonblocking(true).is_err() || stream.set_nodelay(true).is_err() {
            return;
        }
        let link = match &self.key {
            None => None,
            Some(key) => match RecordLink::client_offering(key, u64::from(self.node), RECORD_MAX, self.link_version) {
                Ok(link) => Some(link),
                Err(_) => return,
            },
        };
        let mut wire = Wire::new(stream, link);
        if append_frame(&mut wire.output, meta(0), &Message::Hello(local)).is_err() {
            return;
        }
        self.wire = Some(wire);
        self.snapshot_due = true;
        if let Some(view) = &mut self.view {
            // The leader's first view snapshot starts the view over.
            view.receiving = None;
            view.streaming = false;
        }
        self.wait = Duration::from_millis(50);
        self.counters.connects += 1;
    }

    fn send(&mut self, frames: Vec<(Delta, Vec<DeltaEntry>)>, as_snapshot: bool) -> bool {
        let Some(wire) = self.wire.as_mut() else { return false };
        for (head, entries) in frames {
            self.request += 1;
            let records = Records::from_slice(&entries);
            let message = if as_snapshot { Message::Snapshot(head, records) } else { Message::Delta(head, records) };
            if append_frame(&mut wire.output, meta(self.request), &message).is_err() {
                return false;
            }
            if as_snapshot {
                continue;
            }
            self.counters.deltas += 1;
        }
        if as_snapshot {
            self.counters.snapshots += 1;
        }
        true
    }

    /// The copies the leader asked since the last call.
    pub fn take_copies(&mut self) -> Vec<lake_dp::wire::message::Transfer> {
        core::mem::take(&mut self.copies)
    }

    /// One pass: (re)connects, sends a snapshot where one is due, then
    /// `changes` as deltas (or drops them, counted, with no leader), and
    /// takes the leader's requests.
    pub fn pump(&mut self, locations: &Locations, changes: &[Change]) {
        if self.wire.is_none() {
            self.connect();
        }
        if self.wire.is_none() {
            self.counters.dropped += changes.len() as u64;
            return;
        }
        if self.snapshot_due {
            // The snapshot covers what the changes say too.
            self.snapshot_due = false;
            if !self.send(snapshot(self.node, locations), true) {
                return self.close();
            }
        } else if !changes.is_empty() && !self.send(deltas(self.node, locations, changes), false) {
            return self.close();
        }
        let Some(wire) = self.wire.as_mut() else { return };
        let open = match wire.read() {
            Ok(open) => open && wire.write(),
            Err(e) => {
                self.counters.refused += 1;
                self.last_refusal = Some(e.to_string());
                // Told why (a wrong key's answer) before the close, if it can.
                wire.write();
                self.close();
                // A leader one release behind: its version from the next
                // connection on, made at once.
                if let AuthError::Version(v) = e
                    && lake_dp::auth::handshake::speaks(v)
                    && v < self.link_version
                {
                    self.link_version = v;
                    self.retry_at = Instant::now();
                }
                return;
            }
        };
        if !open || wire.unsent() > OUTPUT_MAX {
            return self.close();
        }
        self.take_frames();
    }

    /// Takes what the leader sent: its asks for a snapshot and for copies,
    /// and the cluster view.
    fn take_frames(&mut self) {
        loop {
            let Some(wire) = self.wire.as_mut() else { return };
            let frame = match decode_frame(&wire.input, &Limits::default()) {
                Err(WireError::Incomplete { .. }) => break,
                Err(_) => return self.close(),
                Ok(frame) => frame,
            };
            let used = frame.len();
            let mut ask_view = None;
            let again = match frame.message {
                Message::HelloAck(ack) => {
                    self.pulls_move = ack.features & FEATURE_PULLS_MOVE != 0;
                    self.spills = ack.features & FEATURE_SPILLS != 0;
                    false
                }
                Message::ViewDelta(head, entries) if self.view.is_some() => {
                    let entries = entries.iter().map(unnamed);
                    ask_view = self.view.as_mut().and_then(|v| v.delta(&head, entries, &mut self.counters));
                    false
                }
                Message::ViewDeltaNamed(head, entries) if self.view.is_some() => {
                    ask_view = self.view.as_mut().and_then(|v| v.delta(&head, entries.iter(), &mut self.counters));
                    false
                }
                Message::ViewSnapshot(head, entries) if self.view.is_some() => {
                    if let Some(view) = self.view.as_mut() {
                        view.snapshot(&head, entries.iter().map(unnamed), &mut self.counters);
                    }
                    false
                }
                Message::ViewSnapshotNamed(head, entries) if self.view.is_some() => {
                    if let Some(view) = self.view.as_mut() {
                        view.snapshot(&head, entries.iter(), &mut self.counters);
                    }
                    false
                }
                Message::SnapshotRequest(request) => request.node == self.node,
                Message::CopyBlock(transfer) if transfer.source.node == self.node => {
                    if self.copies.len() < 4096 {
                        self.copies.push(transfer);
                        self.counters.copies_asked += 1;
                    }
                    false
                }
                _ => return self.close(),
            };
            wire.input.drain(..used);
            if again {
                self.snapshot_due = true;
            }
            if let Some(term) = ask_view {
                let request = Message::SnapshotRequest(SnapshotRequest { node: self.node, reserved: 0, term });
                if append_frame(&mut wire.output, meta(0), &request).is_err() {
                    return self.close();
                }
            }
        }
    }
}

/// A node's connection has this long to say its hello.
pub const HELLO_DEADLINE: Duration = Duration::from_secs(5);

#[derive(Debug)]
struct NodeConnection {
    wire: Wire,
    node: Option<u32>,
    /// When it was accepted.
    since: Instant,
    /// It takes the cluster view (its hello offered it).
    view: bool,
    /// With each block's namespace ([`FEATURE_VIEW_NAMESPACES`]).
    view_named: bool,
    /// It spills its victims here (both ends offered [`FEATURE_SPILLS`]).
    spills: bool,
    /// A view snapshot is owed to it (it connected, asked, or fell behind).
    view_snapshot_due: bool,
    /// Bytes of the last view snapshot queued for it: its output may hold
    /// them on top of [`OUTPUT_MAX`].
    view_allowance: usize,
}

/// The leader's end: accepts the nodes' uplinks and applies what they
/// send to its summary.
#[derive(Debug)]
pub struct Aggregator {
    listener: TcpListener,
    connections: Vec<NodeConnection>,
    local: lake_dp::wire::message::Hello,
    /// Replication copies asked, and when.
    asked: std::collections::HashMap<(BlockKey, u32), Instant>,
    /// Drain copies asked, and when.
    drain_asked: std::collections::HashMap<(BlockKey, u32), Instant>,
    /// Placement copies asked, when, of which node, and how many times.
    placed: std::collections::VecDeque<(Instant, u32, BlockKey, u8)>,
    key: Option<LinkKey>,
    security_events: std::collections::VecDeque<String>,
    /// Nodes' pulls received this pass, relayed at its end.
    pulls: Vec<lake_dp::wire::message::Transfer>,
    /// Nodes' spills received this pass, placed at its end.
    spills: Vec<lake_dp::wire::message::Transfer>,
    /// The view stream's term: this aggregator's start in ms since the
    /// epoch, so a node never takes a later leader's stream for the last.
    view_term: u64,
    /// The last view frame's sequence.
    view_sequence: u64,
    /// Node connections held at once, at most: one past it is accepted
    /// and closed at once.
    pub connections_max: usize,
    /// The summary it keeps.
    pub summary: Summary,
    /// What it has done.
    pub counters: AggregatorCounters,
}

impl Aggregator {
    /// Listens on `address` with `summary` to start from.
    pub fn bind(address: SocketAddr, summary: Summary) -> io::Result<Self> {
        let listener = TcpListener::bind(address)?;
        listener.set_nonblocking(true)?;
        let identity = Identity {
            role: Role::ControlPlane,
            node: 0,
            pid: std::process::id(),
            region_epoch: 0,
            features: FEATURE_VIEW_NAMESPACES,
            name: "lake-leader",
        };
        let local = hello::hello(&identity).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        let mut summary = summary;
        summary.track_view();
        let view_term = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        Ok(Self {
            listener,
            connections: Vec::new(),
            local,
            asked: std::collections::HashMap::new(),
            drain_asked: std::collections::HashMap::new(),
            placed: std::collections::VecDeque::new(),
            key: None,
            security_events: std::collections::VecDeque::new(),
            pulls: Vec::new(),
            spills: Vec::new(),
            view_term,
            view_sequence: 0,
            connections_max: 256,
            summary,
            counters: AggregatorCounters::default(),
        })
    }

    /// Authenticates every node connection accepted from now on with
    /// `key`: a node without it gets no frame applied.
    pub fn authenticate(&mut self, key: LinkKey) {
        self.key = Some(key);
    }

    /// Pulls move blocks to their readers ([`FEATURE_PULLS_MOVE`], acked
    /// to every node that connects from now on): the pool keeps a block
    /// where it was last read.
    pub fn move_pulled_blocks(&mut self) {
        self.local.features |= FEATURE_PULLS_MOVE;
    }

    /// What was refused since the last call, one line each, oldest first:
    /// for the leader's log.
    pub fn take_security_events(&mut self) -> Vec<String> {
        self.security_events.drain(..).collect()
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Nodes connected now.
    pub fn connected(&self) -> Vec<u32> {
        self.connections.iter().filter_map(|c| c.node).collect()
    }

    /// Asks the nodes for the copies of [`Summary::replication_plan`]
    /// (`min_children`, at most `max` a call), each (block, target node)
    /// at most once per `again` (the copy shows in the summary once it
    /// lands). Returns how many were asked.
    pub fn replicate(&mut self, min_children: usize, max: usize, again: Duration) -> usize {
        let now = Instant::now();
        self.asked.retain(|_, at| now.duration_since(*at) < again);
        let asked = &self.asked;
        let plan = self.summary.replication_plan(min_children, max, |key, node| asked.contains_key(&(*key, node)));
        let sent = self.ask_copies(plan, lake_dp::Priority::Replication);
        self.counters.copies_asked += sent.len() as u64;
        for copy in &sent {
            self.asked.insert(*copy, now);
        }
        sent.len()
    }

    /// Asks the nodes for the copies of [`Summary::placement_plan`] (the
    /// blocks they saved, to their homes), at most `max` a call, as
    /// write-backs: the saving node's copy is dropped once the home has
    /// it. A block asked `again` ago is looked at anew (the copy failed,
    /// or its node was not connected: asked again while the node holds it
    /// in L1 and its home does not), three times at most. Returns how
    /// many were asked.
    pub fn place(&mut self, max: usize, again: Duration) -> usize {
        let now = Instant::now();
        let mut tried = std::collections::HashMap::new();
        while let Some(&(at, node, key, tries)) = self.placed.front()
            && now.duration_since(at) >= again
        {
            self.placed.pop_front();
            self.summary.place_again(node, key);
            tried.insert(key, tries);
        }
        let plan = self.summary.placement_plan(max, |_, _| false);
        let planned: Vec<(u32, BlockKey)> = plan.iter().map(|c| (c.from.node.0, c.key)).collect();
        let sent = self.ask_copies(plan, lake_dp::Priority::WriteBack);
        self.counters.placements_asked += sent.len() as u64;
        for (node, key) in planned {
            let tries = tried.get(&key).copied().unwrap_or(0) + 1;
            if tries < 3 && self.placed.len() < super::place::PLACING_MAX {
                self.placed.push_back((now, node, key, tries));
            }
        }
        sent.len()
    }

    /// Drains: asks each draining node to copy the blocks only it holds
    /// into other members' L1 ([`Summary::drain_plan`]), at most `max`,
    /// each (block, target) at most once per `again`; how many were
    /// asked.
    pub fn drain(&mut self, max: usize, again: Duration) -> usize {
        let now = Instant::now();
        self.drain_asked.retain(|_, at| now.duration_since(*at) < again);
        let asked = &self.drain_asked;
        let plan = self.summary.drain_plan(max, |key, node| asked.contains_key(&(*key, node)));
        let sent = self.ask_copies(plan, lake_dp::Priority::Replication);
        self.counters.drain_copies_asked += sent.len() as u64;
        for copy in &sent {
            self.drain_asked.insert(*copy, now);
        }
        sent.len()
    }

    /// Relays the pulls nodes sent this pass: each asks the node the
    /// engine named (or, where it no longer offers the block, another
    /// member that does) to copy the block into the puller's L1 (the
    /// region and epoch the pull names, where it names them: the puller
    /// knows its own best; else the summary's), from its
    /// L1 or, promoting it first, its L2 — or, where no member holds it
    /// there, its L3 (a connected node's: it reads the object, then sends
    /// it).
    fn relay_pulls(&mut self) {
        let mut plan = Vec::new();
        let connected: Vec<u32> = self.connections.iter().filter_map(|c| c.node).collect();
        for pull in core::mem::take(&mut self.pulls) {
            let puller = pull.target.node;
            let to = if pull.target.region_epoch != 0 && pull.target.tier == Tier::L1Dram as u8 {
                Some(lake_dp::model::replica::ReplicaWire { slot: SLOT_ANY, generation: 0, ..pull.target })
            } else {
                self.summary.l1_target(puller)
            };
            let holders = self.summary.replicas(&pull.key);
            let from = holders
                .iter()
                .filter(|r| r.node.0 != puller)
                .filter(|r| match r.tier {
                    Tier::L1Dram | Tier::L2Nvme => true,
                    Tier::L3Object => connected.contains(&r.node.0),
                    Tier::L0Hbm => false,
                })
                .min_by_key(|r| (r.tier == Tier::L3Object, r.node.0 != pull.source.node, r.tier as u8));
            match (to, from) {
                (Some(to), Some(&from)) => plan.push(Replication { key: pull.key, from, to }),
                _ => self.counters.pulls_unheld += 1,
            }
        }
        let sent = self.ask_copies(plan, lake_dp::Priority::CriticalLoad);
        self.counters.pulls_relayed += sent.len() as u64;
    }

    /// Full nodes spill their victims into the pool: each node that
    /// offers [`FEATURE_SPILLS`] sends its L1 victims that would be
    /// dropped, and the leader asks it to place each in the member with
    /// the most room ([`Summary::spill_target`]), as a write-back — its
    /// own copy is dropped once that member has the block. A spill no
    /// member has room for is answered with the node itself as the
    /// target: the node drops the block.
    pub fn place_spills_in_room(&mut self) {
        self.local.features |= FEATURE_SPILLS;
    }

    /// Places the spills nodes sent this pass ([`Aggregator::place_spills_in_room`]).
    fn place_spills(&mut self) {
        if self.spills.is_empty() {
            return;
        }
        let spills = core::mem::take(&mut self.spills);
        let plan = self.summary.spill_plan(&spills, &mut self.counters);
        self.ask_copies(plan, lake_dp::Priority::WriteBack);
    }

    /// Sends each copy to its source node's connection: the (block,
    /// target) of those that went.
    fn ask_copies(&mut self, plan: Vec<Replication>, priority: lake_dp::Priority) -> Vec<(BlockKey, u32)> {
        let mut sent = Vec::new();
        for copy in plan {
            let Some(connection) = self.connections.iter_mut().find(|c| c.node == Some(copy.from.node.0)) else {
                continue;
            };
            let connection = &mut connection.wire;
            let transfer = lake_dp::wire::message::Transfer {
                source: copy.from.to_wire(),
                target: copy.to,
                key: copy.key,
                deadline_unix_ns: 0,
                priority: priority as u8,
                reserved: [0; 7],
            };
            if append_frame(&mut connection.output, meta(0), &Message::CopyBlock(transfer)).is_ok() {
                sent.push((copy.key, copy.to.node));
            }
        }
        sent
    }

    /// Waits until the listener or a node's connection has input, or
    /// `timeout` passes: the leader's loop reacts to a node at once (a
    /// pull is relayed as it comes) instead of on its next round.
    pub fn wait(&self, timeout: Duration) {
        use std::os::fd::AsRawFd;
        let mut fds = Vec::with_capacity(self.connections.len() + 1);
        fds.push(self.listener.as_raw_fd());
        fds.extend(self.connections.iter().map(|c| c.wire.stream.as_raw_fd()));
        if lake_dp::os::wait_readable(&fds, timeout).is_err() {
            std::thread::sleep(timeout);
        }
    }

    /// One pass: accepts, reads and applies, answers.
    pub fn pump(&mut self) {
        loop {
            match self.listener.accept() {
                Ok(_) if self.connections.len() >= self.connections_max => self.counters.over_cap += 1,
                Ok((stream, _)) => {
                    if stream.set_nonblocking(true).is_ok() && stream.set_nodelay(true).is_ok() {
                        self.counters.accepted += 1;
                        let link = self.key.as_ref().map(|key| (RecordLink::server(key, 0, RECORD_MAX), Vec::new()));
                        let connection = NodeConnection {
                            wire: Wire::new(stream, link),
                            node: None,
                            since: Instant::now(),
                            view: false,
                            view_named: false,
                            spills: false,
                            view_snapshot_due: false,
                            view_allowance: 0,
                        };
                        self.connections.push(connection);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(_) => {
                    self.counters.accept_failed += 1;
                    break;
                }
            }
        }
        let mut at = 0;
        while at < self.connections.len() {
            let connection = &self.connections[at];
            let silent = connection.node.is_none() && connection.since.elapsed() > HELLO_DEADLINE;
            if silent {
                self.counters.no_hello += 1;
            }
            let open = !silent && self.serve(at);
            if open {
                at += 1;
            } else {
                self.connections.swap_remove(at);
            }
        }
        self.relay_pulls();
        self.place_spills();
        self.stream_view();
        // What this pass queued goes now, not with the next pass (a
        // pull's copy is waited on); a connection that fails is closed by
        // its next serve.
        for connection in &mut self.connections {
            if connection.wire.unsent() > 0 {
                let _ = connection.wire.write();
            }
        }
    }

    /// The view's term and the last frame's sequence.
    pub fn view_position(&self) -> (u64, u64) {
        (self.view_term, self.view_sequence)
    }

    /// Sends the summary's view changes since the last pass to every node
    /// taking the view, and a snapshot to each one owed one: a node too
    /// far behind gets no deltas, and a snapshot once it has caught up.
    fn stream_view(&mut self) {
        let changes = self.summary.take_view_changes();
        // The deltas in each form a connection takes: without namespaces,
        // and with them ([`FEATURE_VIEW_NAMESPACES`]).
        let wants = |named: bool| self.connections.iter().any(|c| c.view && c.view_named == named);
        let mut deltas = [wants(false).then(Vec::new), wants(true).then(Vec::new)];
        for (node, entries) in &changes {
            for chunk in entries.chunks(DELTA_ENTRIES_MAX) {
                self.view_sequence += 1;
                let head = Delta { term: self.view_term, sequence: self.view_sequence, node: *node, count: 0 };
                for (out, named) in deltas.iter_mut().zip([false, true]) {
                    if let Some(out) = out
                        && append_view_frame(out, head, chunk, false, named).is_err()
                    {
                        return;
                    }
                }
                self.counters.view_deltas += 1;
            }
        }
        let mut snapshots: [Option<Vec<u8>>; 2] = [None, None];
        for connection in &mut self.connections {
            if !connection.view {
                continue;
            }
            let named = connection.view_named;
            let deltas = deltas[usize::from(named)].as_deref().unwrap_or_default();
            let unsent = connection.wire.unsent();
            if unsent <= OUTPUT_MAX {
                connection.view_allowance = 0;
            }
            if !connection.view_snapshot_due && unsent > VIEW_BEHIND_MAX && !deltas.is_empty() {
                connection.view_snapshot_due = true;
                self.counters.view_skipped += 1;
            }
            if connection.view_snapshot_due {
                if unsent > VIEW_BEHIND_MAX {
                    continue;
                }
                // The snapshot is taken after this pass's changes: it covers
                // them, and carries the last sequence made.
                let bytes = snapshots[usize::from(named)].get_or_insert_with(|| {
                    view_snapshot(&self.summary, self.view_term, self.view_sequence, named).unwrap_or_default()
                });
                connection.wire.output.extend_from_slice(bytes);
                connection.view_allowance = bytes.len();
                connection.view_snapshot_due = false;
                self.counters.view_snapshots += 1;
            } else {
                connection.wire.output.extend_from_slice(deltas);
            }
        }
    }

    /// Reads what connection `at` sent; false when it closed or failed its
    /// authentication (said in the security events).
    fn read_from(&mut self, at: usize) -> bool {
        let connection = &mut self.connections[at];
        match connection.wire.read() {
            Ok(open) => open,
            Err(e) => {
                self.counters.refused += 1;
                let from = connection.wire.stream.peer_addr().map_or_else(|_| "?".to_string(), |a| a.to_string());
                if self.security_events.len() >= SECURITY_EVENTS_MAX {
                    self.security_events.pop_front();
                }
                self.security_events.push_back(format!("summary connection from {from} refused: {e}"));
                // A wrong key's answer says so to the node, if it can.
                connection.wire.write();
                false
            }
        }
    }

    /// Serves connection `at`; false when it is to be closed.
    fn serve(&mut self, at: usize) -> bool {
        if !self.read_from(at) {
            return false;
        }
        let connection = &mut self.connections[at];
        let mut used_total = 0;
        loop {
            let input = &connection.wire.input[used_total..];
            let frame = match decode_frame(input, &Limits::default()) {
                Err(WireError::Incomplete { .. }) => break,
                Err(_) => {
                    self.counters.bad_frames += 1;
                    return false;
                }
                Ok(frame) => frame,
            };
            used_total += frame.len();
            let reply = FrameMeta { flags: FLAG_REPLY, ..frame.meta() };
            match frame.message {
                Message::Hello(remote) if connection.node.is_none() => {
                    let Ok(ack) = hello::accept(&self.local, &remote, 0) else {
                        self.counters.bad_frames += 1;
                        return false;
                    };
                    connection.node = Some(remote.node);
                    connection.view = remote.features & FEATURE_CLUSTER_VIEW != 0;
                    connection.view_named = ack.features & FEATURE_VIEW_NAMESPACES != 0;
                    connection.spills = ack.features & FEATURE_SPILLS != 0;
                    connection.view_snapshot_due = connection.view;
                    if append_frame(&mut connection.wire.output, reply, &Message::HelloAck(ack)).is_err() {
                        return false;
                    }
                }
                Message::SnapshotRequest(request) if connection.view && connection.node == Some(request.node) => {
                    connection.view_snapshot_due = true;
                }
                Message::CopyBlock(spill) if connection.spills && is_spill(connection.node, &spill) => {
                    take_pull(&mut self.spills, &mut self.counters.spills_unplaced, spill);
                }
                Message::CopyBlock(pull) if connection.view && connection.node == Some(pull.target.node) => {
                    take_pull(&mut self.pulls, &mut self.counters.pulls_unheld, pull);
                }
                Message::Delta(head, entries) | Message::Snapshot(head, entries)
                    if connection.node == Some(head.node) =>
                {
                    let snapshot = matches!(frame.message, Message::Snapshot(..));
                    let gap = apply_report(&mut self.summary, &mut self.counters, (&head, snapshot), entries.iter());
                    if let Some(request) = gap
                        && append_frame(&mut connection.wire.output, reply, &Message::SnapshotRequest(request)).is_err()
                    {
                        return false;
                    }
                }
                _ => {
                    self.counters.bad_frames += 1;
                    return false;
                }
            }
        }
        connection.wire.input.drain(..used_total);
        connection.wire.write() && connection.wire.unsent() <= OUTPUT_MAX + connection.view_allowance
    }
}
