//! The leader's end of the summary's wire ([`Aggregator`]): it accepts the
//! nodes' uplinks, applies what they send to its [`Summary`], streams
//! each node the cluster view, and asks the nodes for the copies the
//! pool decides (pulls relayed, spills, hot prefixes, drains,
//! placements). See [`super::link`].

use std::io;
use std::net::{SocketAddr, TcpListener};
use std::time::{Duration, Instant};

use lake_dp::auth::{LinkKey, RecordLink};
use lake_dp::constants::DELTA_ENTRIES_MAX;
use lake_dp::wire::hello::{self, Identity};
use lake_dp::wire::message::{Delta, DeltaEntry, Hello, HelloAck, KeptApartEntry, Role, SLOT_ANY, SnapshotRequest};
use lake_dp::wire::{
    FEATURE_CLUSTER_VIEW, FEATURE_KEPT_APART, FEATURE_PULLS_MOVE, FEATURE_SPILLS, FEATURE_VIEW_NAMESPACES, FLAG_REPLY,
    FrameMeta, Limits, Message, WireError, append_frame, decode_frame,
};
use lake_dp::{BlockKey, Tier};

use super::apart::Apart;
use super::conn::Wire;
use super::link::{OUTPUT_MAX, RECORD_MAX, SECURITY_EVENTS_MAX, VIEW_BEHIND_MAX, meta};
use super::view::{append_view_frame, view_snapshot};
use super::{AggregatorCounters, Outcome, Replication, Summary};
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
    /// Its list of what it keeps apart is owed ([`FEATURE_KEPT_APART`]):
    /// nothing else of it is taken first.
    apart_due: bool,
    /// Bytes of the last view snapshot queued for it: its output may hold
    /// them on top of [`OUTPUT_MAX`].
    view_allowance: usize,
}

impl NodeConnection {
    /// Takes node `remote`'s hello, answered `ack`: what the node takes
    /// of the leader. A node keeping tenants apart is sent its view once
    /// it said what it keeps apart; one that says nothing keeps nothing
    /// apart.
    fn greeted(&mut self, remote: &Hello, ack: &HelloAck) {
        self.node = Some(remote.node);
        self.view = remote.features & FEATURE_CLUSTER_VIEW != 0;
        self.view_named = ack.features & FEATURE_VIEW_NAMESPACES != 0;
        self.spills = ack.features & FEATURE_SPILLS != 0;
        self.apart_due = ack.features & FEATURE_KEPT_APART != 0;
        self.view_snapshot_due = self.view && !self.apart_due;
    }
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
    /// Nodes that said what they keep apart, each with the nodes that
    /// keep a namespace apart otherwise, for the leader's log.
    unlike: Vec<(u32, Vec<u32>)>,
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
            features: FEATURE_VIEW_NAMESPACES | FEATURE_KEPT_APART,
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
            unlike: Vec::new(),
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

    /// Each node that connected since the last call keeping a namespace
    /// apart otherwise than other nodes, with those nodes, for the
    /// leader's log: blocks a holder keeps apart pass only between nodes
    /// that keep them apart alike.
    pub fn take_unlike(&mut self) -> Vec<(u32, Vec<u32>)> {
        core::mem::take(&mut self.unlike)
    }

    /// Node `node` keeps `entries` apart: noted, and said where it keeps
    /// any namespace apart otherwise than another node.
    fn kept_apart(
        summary: &mut Summary,
        unlike: &mut Vec<(u32, Vec<u32>)>,
        node: u32,
        entries: impl IntoIterator<Item = KeptApartEntry>,
    ) {
        summary.kept_apart(node, entries);
        if !summary.keeps_any_apart() || unlike.len() >= SECURITY_EVENTS_MAX {
            return;
        }
        let others = summary.unlike(node);
        if !others.is_empty() {
            unlike.push((node, others));
        }
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
                // A holder that may send it here first (else the copy is
                // refused, counted, in `ask_copies`).
                .min_by_key(|r| {
                    let unlike = !self.summary.may_move(&pull.key, r.node.0, puller);
                    (unlike, r.tier == Tier::L3Object, r.node.0 != pull.source.node, r.tier as u8)
                });
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
    /// target) of those that went. A copy of a block its holder keeps
    /// apart to a node that does not keep it apart alike goes nowhere
    /// (counted: `copies_kept_apart`).
    fn ask_copies(&mut self, plan: Vec<Replication>, priority: lake_dp::Priority) -> Vec<(BlockKey, u32)> {
        let mut sent = Vec::new();
        for copy in plan {
            if !self.summary.may_move(&copy.key, copy.from.node.0, copy.to.node) {
                self.counters.copies_kept_apart += 1;
                continue;
            }
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
                            apart_due: false,
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
        // Connections alike see alike: the deltas are made once for each
        // form a connection takes — without namespaces, or with them
        // ([`FEATURE_VIEW_NAMESPACES`]) — and each set of tenants kept
        // apart among them ([`super::apart`]).
        let mut seers: Vec<(bool, &Apart)> = Vec::new();
        let mut seer_of = Vec::with_capacity(self.connections.len());
        for connection in &self.connections {
            let seer = (connection.view_named, self.summary.apart_of(connection.node.unwrap_or(0)));
            let at = seers.iter().position(|s| *s == seer).unwrap_or_else(|| {
                seers.push(seer);
                seers.len() - 1
            });
            seer_of.push(at);
        }
        let mut deltas = vec![Vec::new(); seers.len()];
        for (node, entries) in &changes {
            for chunk in entries.chunks(DELTA_ENTRIES_MAX) {
                self.view_sequence += 1;
                let head = Delta { term: self.view_term, sequence: self.view_sequence, node: *node, count: 0 };
                for (out, &(named, apart)) in deltas.iter_mut().zip(&seers) {
                    let shown = self.summary.shown(*node, chunk, apart);
                    if append_view_frame(out, head, &shown, false, named).is_err() {
                        return;
                    }
                }
                self.counters.view_deltas += 1;
            }
        }
        let mut snapshots: Vec<Option<Vec<u8>>> = vec![None; seers.len()];
        for (connection, &seer) in self.connections.iter_mut().zip(&seer_of) {
            if !connection.view || connection.apart_due {
                continue;
            }
            let (named, apart) = seers[seer];
            let deltas = &deltas[seer];
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
                let bytes = snapshots[seer].get_or_insert_with(|| {
                    let at = (self.view_term, self.view_sequence);
                    view_snapshot(&self.summary, at, named, apart).unwrap_or_default()
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
                    connection.greeted(&remote, &ack);
                    if !connection.apart_due {
                        Self::kept_apart(&mut self.summary, &mut self.unlike, remote.node, []);
                    }
                    if append_frame(&mut connection.wire.output, reply, &Message::HelloAck(ack)).is_err() {
                        return false;
                    }
                }
                Message::KeptApart(_, entries) if connection.apart_due => {
                    (connection.apart_due, connection.view_snapshot_due) = (false, connection.view);
                    let node = connection.node.unwrap_or_default();
                    Self::kept_apart(&mut self.summary, &mut self.unlike, node, entries.iter());
                }
                _ if connection.apart_due => {
                    self.counters.bad_frames += 1;
                    return false;
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
