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

use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use lake_dp::BlockKey;
use lake_dp::auth::{AuthError, LinkKey, RecordLink};
use lake_dp::mirror::view::ViewWriter;
use lake_dp::wire::hello::{self, HELLO_WIRE_VERSION, Identity};
use lake_dp::wire::message::{Delta, DeltaEntry, KeptApart, KeptApartEntry, Records, Role, SLOT_ANY, SnapshotRequest};
use lake_dp::wire::{
    FEATURE_CLUSTER_VIEW, FEATURE_KEPT_APART, FEATURE_PULLS_MOVE, FEATURE_SPILLS, FEATURE_VIEW_NAMESPACES, FrameMeta,
    Limits, Message, WireError, append_frame, decode_frame,
};

pub use super::aggregator::{Aggregator, HELLO_DEADLINE};
use super::conn::Wire;
pub use super::report::{deltas, entry_of, snapshot};
pub use super::view::NodeViews;
use super::view::{ViewCopy, unnamed};
pub use super::{AggregatorCounters, UplinkCounters};
use crate::location::{Change, Locations};

/// A connection's output past this is cut (the peer does not read): the
/// node reconnects and sends a snapshot. A view snapshot queued for it
/// counts apart.
pub(super) const OUTPUT_MAX: usize = 64 << 20;

/// A node's connection with more than this unsent gets no more view
/// deltas: a view snapshot once it has caught up instead.
pub const VIEW_BEHIND_MAX: usize = 16 << 20;

pub(super) fn meta(request_id: u64) -> FrameMeta {
    FrameMeta { version: HELLO_WIRE_VERSION, flags: 0, request_id, leader_term: 0 }
}

/// Bytes a record of the link carries at most (a snapshot frame of
/// [`lake_dp::constants::DELTA_ENTRIES_MAX`] entries is far smaller).
pub(super) const RECORD_MAX: usize = 16 << 20;

/// Security events an aggregator keeps for its caller, at most.
pub(super) const SECURITY_EVENTS_MAX: usize = 64;

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
    /// The namespaces this node keeps apart, each with its tenant: said to
    /// every leader that takes them ([`FEATURE_KEPT_APART`]).
    apart: Vec<KeptApartEntry>,
    /// The leader's ack is awaited before anything is reported: a node
    /// keeping tenants apart says so first.
    ack_due: bool,
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
            apart: Vec::new(),
            ack_due: false,
            counters: UplinkCounters::default(),
        }
    }

    /// Says to every leader, before its first report, the namespaces
    /// this node keeps apart and the tenant each is kept for: `tenants`,
    /// each a tenant's name and its namespaces. The leader moves the
    /// blocks of those only to nodes keeping them apart alike, and shows
    /// them in no other node's view. A leader built before this is told
    /// nothing (and checks nothing).
    #[must_use]
    pub fn with_kept_apart(mut self, tenants: &[(String, Vec<u64>)]) -> Self {
        self.apart = tenants
            .iter()
            .flat_map(|(tenant, namespaces)| {
                let tenant = KeptApartEntry::tenant_of(tenant);
                namespaces.iter().filter(|&&n| n != 0).map(move |&namespace| KeptApartEntry { namespace, tenant })
            })
            .collect();
        self
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
            } | if self.apart.is_empty() { 0 } else { FEATURE_KEPT_APART },
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
        self.ack_due = !self.apart.is_empty();
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
        // Until the ack, nothing: the snapshot that follows it covers the
        // changes meanwhile.
        if !self.ack_due && !self.report(locations, changes) {
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
        let acked = self.ack_due;
        self.take_frames();
        if acked && !self.ack_due && self.wire.is_some() && !self.report(locations, &[]) {
            self.close();
        }
    }

    /// Sends a snapshot where one is due, else `changes` as deltas: false
    /// where the connection failed.
    fn report(&mut self, locations: &Locations, changes: &[Change]) -> bool {
        if self.snapshot_due {
            // The snapshot covers what the changes say too.
            self.snapshot_due = false;
            return self.send(snapshot(self.node, locations), true);
        }
        changes.is_empty() || self.send(deltas(self.node, locations, changes), false)
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
                    if self.ack_due && ack.features & FEATURE_KEPT_APART != 0 {
                        let count = u32::try_from(self.apart.len()).unwrap_or(u32::MAX);
                        let list =
                            Message::KeptApart(KeptApart { count, reserved: 0 }, Records::from_slice(&self.apart));
                        if append_frame(&mut wire.output, meta(0), &list).is_err() {
                            return self.close();
                        }
                    }
                    self.ack_due = false;
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
