//! The control plane's end of the simulated node's link, the view it
//! keeps from the node's reports, and the `Control` that commands it.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;

use super::tally::Tally;
use super::{GONE_MAX, NODE, RANDOM_REQUESTS, index_below};
use crate::cplink::CpLink;
use crate::model::key::BlockKey;
use crate::model::replica::{ReplicaWire, Tier};
use crate::rng::SimRng;
use crate::wire::hello::{self, Identity};
use crate::wire::message::Role;
use crate::wire::message::{BlockEvicted, ErrorCode};
use crate::wire::{FrameMeta, Limits, Message, WireError, decode_frame, encode_frame};

/// What the test's control plane is waiting for, by request id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Commanded {
    Demote,
    WriteBack,
    Promote,
    /// Written to L3: copied from L1, or moved from L2.
    ToL3,
    /// Copied from L3 to L1.
    FromL3,
    /// Copied to the peer node's L1.
    ToPeer,
    Evict,
    /// The [`Control`]'s.
    Control,
}

/// The control plane's end of the link, and its view of the node.
pub(super) struct SimCp {
    pub(super) end: UnixStream,
    pub(super) input: Vec<u8>,
    pub(super) have: usize,
    pub(super) limits: Limits,
    pub(super) version: u16,
    pub(super) next_request: u64,
    /// The replicas reported committed and not evicted since, by tier and
    /// slot: what a control plane believes the node holds.
    pub(super) replicas: BTreeMap<(u8, u16, u32), (ReplicaWire, BlockKey)>,
    pub(super) commanded: BTreeMap<u64, Commanded>,
    /// Replicas evicted lately: what a control plane's view lagging
    /// behind the node still names.
    pub(super) gone: Vec<(ReplicaWire, BlockKey)>,
    /// What crossed the link, for a failing seed's message.
    pub(super) log: Vec<String>,
    pub(super) seed: u64,
}

impl SimCp {
    pub(super) fn command(&mut self, message: &Message<'_>, what: Commanded) {
        let request = self.next_request;
        self.next_request += 1;
        self.send(request, message, Some(what));
    }

    /// Sends `message` under `request`; `what`: an answer is owed.
    pub(super) fn send(&mut self, request: u64, message: &Message<'_>, what: Option<Commanded>) {
        let meta = FrameMeta { version: self.version, flags: 0, request_id: request, leader_term: 0 };
        let mut frame = [0u8; 512];
        let len = encode_frame(meta, message, &mut frame).expect("a command frame");
        self.end.write_all(&frame[..len]).expect("the link's socket takes a command");
        self.log.push(format!("cp -> dp {request}: {message:?}"));
        if let Some(what) = what {
            let old = self.commanded.insert(request, what);
            assert!(old.is_none(), "seed {}: request {request} sent twice", self.seed);
        }
    }

    /// Marks an L1 replica evictable (not answered).
    pub(super) fn mark(&mut self, marked: &BlockEvicted) {
        let meta = FrameMeta { version: self.version, flags: 0, request_id: 0, leader_term: 0 };
        let mut frame = [0u8; 512];
        let len = encode_frame(meta, &Message::MarkEvictable(*marked), &mut frame).expect("a mark frame");
        self.end.write_all(&frame[..len]).expect("the link's socket takes a mark");
        self.log.push(format!("cp -> dp: mark {marked:?}"));
    }

    /// Reads what the data plane reported, keeping the view, and hands
    /// every frame to `control`.
    pub(super) fn read(&mut self, tally: &mut Tally, control: &mut dyn Control) {
        loop {
            match self.end.read(&mut self.input[self.have..]) {
                Ok(0) => panic!("the data plane closed the link"),
                Ok(n) => self.have += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("reading the link: {e}"),
            }
        }
        // Out of `self` while its frames are read (they borrow it).
        let input = core::mem::take(&mut self.input);
        let mut at = 0;
        loop {
            let frame = match decode_frame(&input[at..self.have], &self.limits) {
                Ok(frame) => frame,
                Err(WireError::Incomplete { .. }) => break,
                Err(e) => panic!("the data plane sent a bad frame: {e:?}"),
            };
            at += frame.len();
            if matches!(
                frame.message,
                Message::BlockCommitted(_)
                    | Message::BlockReadopted(_)
                    | Message::BlockEvicted(_)
                    | Message::TransferDone(_)
            ) {
                self.log.push(format!("dp -> cp {}: {:?}", frame.header.request_id, frame.message));
            }
            control.received(frame.header.request_id, &frame.message);
            self.note(frame.header.request_id, &frame.message, tally);
        }
        self.input = input;
        self.input.copy_within(at..self.have, 0);
        self.have -= at;
    }

    /// Keeps the view as the node's report `message` (of `request`) tells.
    fn note(&mut self, request: u64, message: &Message<'_>, tally: &mut Tally) {
        match *message {
            Message::BlockCommitted(block) | Message::BlockReadopted(block) => {
                let r = block.replica;
                let old = self.replicas.insert((r.tier, r.region, r.slot), (r, block.key));
                // The one replica reported again is fine (an L3 write
                // of a block the store holds already reports it).
                assert!(
                    old.is_none_or(|held| held == (r, block.key)),
                    "seed {}: a commit into a slot the view still holds: {old:?} then {block:?}\n{}",
                    self.seed,
                    self.log[self.log.len().saturating_sub(30)..].join("\n")
                );
            }
            Message::BlockEvicted(evicted) => {
                let r = evicted.replica;
                let held = self.replicas.remove(&(r.tier, r.region, r.slot));
                if self.gone.len() == GONE_MAX {
                    self.gone.remove(0);
                }
                self.gone.push((r, evicted.key));
                assert!(
                    held.is_some_and(|(h, key)| h.generation == r.generation && key == evicted.key),
                    "seed {}: an eviction of a replica the view did not hold: {evicted:?}, held {held:?}\n{}",
                    self.seed,
                    self.log.join("\n")
                );
            }
            Message::TransferDone(done) => {
                let what = self.commanded.remove(&request);
                assert!(what.is_some(), "seed {}: an answer to no command: {done:?}", self.seed);
                if what == Some(Commanded::ToPeer) && done.status == ErrorCode::Cancelled as u32 {
                    tally.peer_cancelled += 1;
                }
                if done.status == 0 {
                    match what {
                        Some(Commanded::Demote) => tally.demotions += 1,
                        Some(Commanded::WriteBack) => tally.write_backs += 1,
                        Some(Commanded::Promote) => tally.cp_promotions += 1,
                        Some(Commanded::ToL3) => tally.l3_writes += 1,
                        Some(Commanded::FromL3) => tally.l3_promotions += 1,
                        Some(Commanded::ToPeer) => tally.peer_copies += 1,
                        Some(Commanded::Control) => tally.controlled += 1,
                        _ => tally.evictions += 1,
                    }
                }
            }
            _ => {}
        }
    }

    /// A replica of `tier` the view holds, or one in eight times one it
    /// held once (a command from a view that lags).
    pub(super) fn pick(&self, rng: &mut SimRng, tier: Tier) -> Option<(ReplicaWire, BlockKey)> {
        let stale = rng.below(8) == 0;
        let of_tier: Vec<_> = if stale {
            self.gone.iter().filter(|(r, _)| r.tier == tier as u8).collect()
        } else {
            self.replicas.values().filter(|(r, _)| r.tier == tier as u8).collect()
        };
        if of_tier.is_empty() {
            return None;
        }
        Some(*of_tier[index_below(rng, of_tier.len())])
    }
}

/// The link's two ends with the hellos agreed by the real negotiation.
pub(super) fn link_pair(seed: u64, epoch: u64) -> (CpLink, SimCp) {
    let (dp_end, cp_end) = UnixStream::pair().expect("a socket pair");
    let identity =
        |role, name| Identity { role, node: NODE, pid: 1, region_epoch: epoch, features: crate::wire::FEATURES, name };
    let dp = hello::hello(&identity(Role::DataPlane, "sim-dp")).expect("the data plane's hello");
    let cp = hello::hello(&identity(Role::ControlPlane, "sim-cp")).expect("the control plane's hello");
    let ack = hello::accept(&cp, &dp, 0).expect("the hellos agree");
    let limits = hello::limits_after(&ack).expect("limits");
    cp_end.set_nonblocking(true).expect("non-blocking");
    let link = CpLink::over(dp_end, ack).expect("the data plane's link");
    let cp = SimCp {
        end: cp_end,
        input: vec![0; 1 << 20],
        have: 0,
        limits,
        version: ack.version,
        next_request: RANDOM_REQUESTS,
        replicas: BTreeMap::new(),
        commanded: BTreeMap::new(),
        gone: Vec::with_capacity(GONE_MAX),
        log: Vec::new(),
        seed,
    };
    (link, cp)
}

/// What plays the control plane beside the simulation's own view: it
/// sees every frame the node sends, in order, and may send commands
/// after each pass.
pub trait Control {
    /// A frame the node sent: a report, or an answer to a command
    /// (`request` echoes it).
    fn received(&mut self, request: u64, message: &Message<'_>);
    /// Commands to send now, each under its request id (ids at or above
    /// `1 << 60` are the simulation's own): tier moves and copies,
    /// evictions, drains, marks.
    fn commands(&mut self, now_ns: u64, out: &mut Vec<(u64, Message<'static>)>);
    /// The node's link closed (its process died): what was commanded on
    /// it will not be answered. The node's next incarnation reports on a
    /// new link.
    fn link_lost(&mut self) {}
}

/// No control: the simulation's random commands alone.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoControl;

impl Control for NoControl {
    fn received(&mut self, _request: u64, _message: &Message<'_>) {}
    fn commands(&mut self, _now_ns: u64, _out: &mut Vec<(u64, Message<'static>)>) {}
}
