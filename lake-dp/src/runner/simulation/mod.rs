//! The block service under the deterministic simulator.
//!
//! The real [`Pool`], slot table, L2 slot map and poller run as the
//! runner runs them, pass after pass, over the simulated disk
//! ([`SimDisk`], with its faults) on a virtual clock. Around them:
//!
//! - **agents**: in-process ports (the real rings) on which the test
//!   saves (reserve, write the object, commit — some with a payload that
//!   does not match its CRCs) and loads from L2;
//! - **the object store** (most seeds): L3 in memory ([`SimStore`]),
//!   kept across restarts and failing as the seed says, under the real
//!   L3 tier and catalog; its client runs the store's calls inside the
//!   node's passes, a seeded share at a time, and the catalog scan a
//!   starting node makes is taken batch by batch between passes, as from
//!   its thread;
//! - **the control plane**: the far end of a real [`CpLink`] over a
//!   socket pair. The simulation reads the data plane's reports from it
//!   (every block committed or evicted) to keep the view a control plane
//!   keeps; tier commands come from a [`Control`] — random ones chosen
//!   from that view, or, in `lake-cp`'s tests, the real tier manager
//!   (`lake_cp::node::Node`) fed every frame.
//!
//! One seeded PRNG chooses every step, so a failing seed replays. What
//! must hold, every seed: a load answered `Ok`, or a block read in L1
//! whose checks pass, holds exactly the bytes that were saved under its
//! key; a commit whose CRCs were not computed by Lake and do not match is
//! refused; every block in L3 before a crash is found again after it
//! (where the store did not fail); and once everything is evicted, every
//! L1 and L2 slot and L3 catalog entry is free again and the control
//! plane's view is empty (no slot leaked, no block the control plane was
//! not told about).

use std::collections::BTreeMap;
use std::sync::Arc;

use super::os::Wakeup;
use crate::agent::port::{AgentError, AgentPort, AgentRequest, CrcOrigin, port};
use crate::io::Clock;
use crate::l2::Readoption;
use crate::model::key::BlockKey;
use crate::model::namespace::NamespaceId;
use crate::model::replica::{ObjectKind, Priority, RegionId, ReplicaWire, Tier};
use crate::rng::SimRng;
use crate::sim::{CrashKind, SimDisk, SimFaults};
use crate::stored::{ObjectMeta, ReadableObject, Reader, encode_object, object_bytes};
use crate::wire::Message;
use crate::wire::message::{BlockEvicted, EvictReason, SLOT_ANY, Transfer};

mod cp;
mod link;
mod node;
mod store;
mod tally;

use crate::transport::frame::AckStatus;
use cp::{Commanded, SimCp, link_pair};
pub use cp::{Control, NoControl};
use link::{Arrival, Arriving};
use node::SimNode;
use store::SimStore;
pub use tally::Tally;

const NODE: u32 = 1;
const EPOCH: u64 = 9;
const L1_SLOTS: u32 = 24;
const L2_SLOTS: u32 = 40;
const SLOT_BYTES: u64 = 16 * 1024;
const SEGMENT_BYTES: u64 = 4096;
/// Payload bytes a save writes at most: three segments.
const PAYLOAD_MAX: usize = 3 * 4096;
const AGENTS: usize = 2;
const PORT_DEPTH: usize = 16;
const OPS: u32 = 32;
const BUDGET: u32 = 16;
/// Virtual time one pass takes.
const PASS_NS: u64 = 10_000;
const NAMESPACE: NamespaceId = NamespaceId(5);
const LAYOUT: u64 = 0x1a7e;
/// With random commands, a step crashes and restarts the node one time in
/// this many.
const RESTART_ONE_IN: u64 = 400;
/// Request ids of the simulation's own commands: apart from a control's.
const RANDOM_REQUESTS: u64 = 1 << 60;
/// Evicted replicas the control plane remembers, to name stale ones.
const GONE_MAX: usize = 64;
/// The L3 region, and the objects its catalog holds.
const L3_REGION: u16 = 700;
const L3_OBJECTS: u32 = 48;
/// L3 requests in flight at most.
const L3_QUEUE: u32 = 8;
/// Seeds that are a multiple of this run with no object store.
const NO_L3_EVERY: u64 = 5;

/// What an agent is waiting for, by cookie.
#[derive(Clone, Debug)]
enum Asked {
    Reserve { key: BlockKey, damage: Damage, crcs: CrcOrigin },
    Commit { key: BlockKey, damage: Damage, crcs: CrcOrigin },
    Load { key: BlockKey, from: Tier },
}

/// How an agent's save is wrong, where it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Damage {
    None,
    /// A payload byte its CRCs do not match.
    Payload,
    /// A header that names another generation of the slot.
    Generation,
}

struct SimAgent {
    port: AgentPort,
    next_cookie: u64,
    asked: BTreeMap<u64, Asked>,
}

fn key_of(n: u64) -> BlockKey {
    let mut key = [0x5e; 16];
    key[..8].copy_from_slice(&n.to_le_bytes());
    BlockKey(key)
}

/// The stored header of block `key`, `payload_len` bytes, naming `slot`
/// (its slot and generation) in `region` (its id and epoch).
fn meta_of(key: BlockKey, payload_len: usize, region: (RegionId, u64), slot: (u32, u32)) -> ObjectMeta {
    ObjectMeta {
        kind: ObjectKind::KvBlock,
        key,
        parent_key: BlockKey::NONE,
        block_index: 0,
        namespace: NAMESPACE,
        layout_fingerprint: LAYOUT,
        region: region.0,
        region_epoch: region.1,
        slot: slot.0,
        generation: slot.1,
        committed_unix_ns: 0,
        payload_len: payload_len as u64,
        segment_bytes: SEGMENT_BYTES,
    }
}

fn reader() -> Reader {
    Reader { namespace: NAMESPACE, layout_fingerprint: LAYOUT, kind: ObjectKind::KvBlock }
}

/// A number below `bound` (a length or a count).
fn index_below(rng: &mut SimRng, bound: usize) -> usize {
    usize::try_from(rng.below(bound as u64)).unwrap_or(0)
}

/// The payload saved under block number `n`.
fn payload_of(n: u64, rng_seed: u64) -> Vec<u8> {
    let mut rng = SimRng::new(rng_seed ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let len = 1 + index_below(&mut rng, PAYLOAD_MAX);
    (0..len).map(|_| rng.next_u64().to_le_bytes()[0]).collect()
}

/// A seeded run of one node: its agents' saves and loads, the control's
/// commands (and, where asked, random ones), every step chosen by one
/// PRNG, every property in the module's comment checked as it goes and
/// at [`Simulation::finish`].
pub struct Simulation<C: Control> {
    node: SimNode,
    cp: SimCp,
    control: C,
    /// Whether the simulation sends random tier commands of its own.
    random_commands: bool,
    /// Whether the node's process dies now and then and starts again.
    restarts: bool,
    /// Whether the control still sends commands (not once the run ends).
    controlling: bool,
    commands: Vec<(u64, Message<'static>)>,
    agents: Vec<SimAgent>,
    /// The object store, if the seed has one.
    store: Option<SimStore>,
    /// A copy to the peer to take back at the next copy.
    take_back: Option<u64>,
    /// The bytes saved under each key.
    saved: BTreeMap<BlockKey, Vec<u8>>,
    /// L2 slots the last re-adoption could not read (kept out of use).
    quarantined: u64,
    /// Keys published with a payload their CRCs do not match.
    damaged: std::collections::BTreeSet<BlockKey>,
    next_block: u64,
    seed: u64,
    rng: SimRng,
    tally: Tally,
}

impl<C: Control> core::fmt::Debug for Simulation<C> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Simulation").field("seed", &self.seed).field("tally", &self.tally).finish_non_exhaustive()
    }
}

/// A node started over `disk` with what re-adoption `found` there, its
/// agents on fresh ports and its link's far end: a first start, or one
/// after a crash.
fn boot(seed: u64, disk: SimDisk, store: Option<&SimStore>, found: &Readoption) -> (SimNode, SimCp, Vec<SimAgent>) {
    let wakeup = Arc::new(Wakeup::new().expect("an eventfd"));
    let (agent_ports, dp_ports): (Vec<_>, Vec<_>) = (0..AGENTS).map(|_| port(PORT_DEPTH, Arc::clone(&wakeup))).unzip();
    let (link, cp) = link_pair(seed, found.epoch);
    let node = SimNode::start(seed, disk, store, found, dp_ports, link, wakeup);
    let agents =
        agent_ports.into_iter().map(|port| SimAgent { port, next_cookie: 1, asked: BTreeMap::new() }).collect();
    (node, cp, agents)
}

impl<C: Control> Simulation<C> {
    /// A node for `seed` (faults as [`faults_for`] gives them), commanded
    /// by `control` and, with `random_commands`, by the simulation too,
    /// which then also restarts it now and then (see
    /// [`Simulation::with_restarts`]).
    pub fn new(seed: u64, control: C, random_commands: bool) -> Self {
        let file_bytes = usize::try_from(u64::from(L2_SLOTS) * SLOT_BYTES).expect("small");
        let disk = SimDisk::new(seed, faults_for(seed), OPS as usize, 1, file_bytes);
        let found = Readoption { epoch: EPOCH, ..Readoption::default() };
        let store = (!seed.is_multiple_of(NO_L3_EVERY)).then(|| SimStore::new(seed));
        let (node, cp, agents) = boot(seed, disk, store.as_ref(), &found);
        Self {
            node,
            cp,
            control,
            random_commands,
            restarts: random_commands,
            controlling: true,
            commands: Vec::new(),
            agents,
            store,
            take_back: None,
            saved: BTreeMap::new(),
            damaged: std::collections::BTreeSet::new(),
            quarantined: 0,
            next_block: 0,
            seed,
            rng: SimRng::new(seed),
            tally: Tally::default(),
        }
    }

    /// Whether the node's process dies now and then (one step in 400) and
    /// starts again, its control told that the link went
    /// ([`Control::link_lost`]) before the new incarnation reports.
    pub fn with_restarts(mut self, restarts: bool) -> Self {
        self.restarts = restarts;
        self
    }

    fn ask(&mut self, agent: usize, request: impl FnOnce(u64) -> AgentRequest, asked: Asked) {
        let a = &mut self.agents[agent];
        let cookie = a.next_cookie;
        a.next_cookie += 1;
        assert!(a.port.submit(request(cookie)).is_ok(), "room was checked");
        a.asked.insert(cookie, asked);
    }

    /// One step the PRNG chose, then a pass, then everything answered.
    fn step(&mut self) {
        let agent = index_below(&mut self.rng, AGENTS);
        let room = self.agents[agent].asked.len() < PORT_DEPTH / 2;
        let commanding = self.random_commands;
        if self.restarts && self.rng.below(RESTART_ONE_IN) == 0 {
            let kind = if self.rng.below(4) == 0 { CrashKind::PowerLoss } else { CrashKind::Process };
            self.restart(kind);
        }
        match self.rng.below(100) {
            0..35 if room => self.save(agent),
            35..55 if commanding => {
                // Demoted (moved), written back (copied) or, from L2,
                // promoted by the control plane; with a store, written to
                // L3 (copied from L1, moved from L2) or promoted from it.
                let choices = if self.store.is_some() { 12 } else { 8 };
                let (from, to, what) = match self.rng.below(choices) {
                    0..5 => (Tier::L1Dram, Tier::L2Nvme, Commanded::Demote),
                    5..7 => (Tier::L1Dram, Tier::L2Nvme, Commanded::WriteBack),
                    7 => (Tier::L2Nvme, Tier::L1Dram, Commanded::Promote),
                    8 => (Tier::L1Dram, Tier::L3Object, Commanded::ToL3),
                    9 => (Tier::L2Nvme, Tier::L3Object, Commanded::ToL3),
                    _ => (Tier::L3Object, Tier::L1Dram, Commanded::FromL3),
                };
                if let Some((replica, key)) = self.cp.pick(&mut self.rng, from) {
                    let region = match to {
                        Tier::L1Dram => self.node.node.header.region,
                        Tier::L3Object => L3_REGION,
                        _ => replica.region,
                    };
                    let target = ReplicaWire { tier: to as u8, region, slot: SLOT_ANY, generation: 0, ..replica };
                    let moving = what == Commanded::Demote || (what == Commanded::ToL3 && from == Tier::L2Nvme);
                    self.transfer(replica, target, key, what, moving);
                }
            }
            55..60 if commanding => {
                // A victim the control plane offers: a save or a load that
                // finds L1 full may take it.
                if let Some((replica, key)) = self.cp.pick(&mut self.rng, Tier::L1Dram) {
                    let marked = BlockEvicted { replica, key, reason: EvictReason::Capacity as u8, reserved: [0; 7] };
                    self.cp.mark(&marked);
                }
            }
            60..66 if commanding => {
                let tier = match self.rng.below(if self.store.is_some() { 3 } else { 2 }) {
                    0 => Tier::L1Dram,
                    1 => Tier::L2Nvme,
                    _ => Tier::L3Object,
                };
                if let Some((replica, key)) = self.cp.pick(&mut self.rng, tier) {
                    let evicted = BlockEvicted { replica, key, reason: EvictReason::Capacity as u8, reserved: [0; 7] };
                    self.cp.command(&Message::EvictBlock(evicted), Commanded::Evict);
                }
            }
            66..85 if room => {
                let from = if self.store.is_some() && self.rng.below(3) == 0 { Tier::L3Object } else { Tier::L2Nvme };
                if let Some((source, key)) = self.cp.pick(&mut self.rng, from) {
                    let load =
                        |cookie| AgentRequest::Load { cookie, key, source, priority: Priority::CriticalLoad, trace: 0 };
                    self.ask(agent, load, Asked::Load { key, from });
                }
            }
            85..93 => self.hit(),
            93..97 => self.peer_sends(),
            97..100 if commanding => self.copy_to_peer(),
            _ => {}
        }
        self.settle();
    }

    fn transfer(&mut self, source: ReplicaWire, target: ReplicaWire, key: BlockKey, what: Commanded, moving: bool) {
        let transfer = Transfer {
            source,
            target,
            key,
            deadline_unix_ns: 0,
            priority: Priority::WriteBack as u8,
            reserved: [0; 7],
        };
        let message = if moving { Message::MoveBlock(transfer) } else { Message::CopyBlock(transfer) };
        self.cp.command(&message, what);
    }

    fn save(&mut self, agent: usize) {
        let n = self.next_block;
        self.next_block += 1;
        let key = key_of(n);
        let payload = payload_of(n, self.seed);
        let object = object_bytes(payload.len() as u64);
        self.saved.insert(key, payload);
        // One save in 16 writes a payload its CRCs do not match (half of
        // those say the CRCs are the agent's own: published first, checked
        // after; half say nothing of them: checked before publishing); one
        // in 32 a header naming another generation of its slot.
        let damage = match self.rng.below(32) {
            0 | 1 => Damage::Payload,
            2 => Damage::Generation,
            _ => Damage::None,
        };
        let crcs = if self.rng.below(2) == 0 { CrcOrigin::Slot } else { CrcOrigin::Unknown };
        self.ask(
            agent,
            |cookie| AgentRequest::Reserve { cookie, object_bytes: object },
            Asked::Reserve { key, damage, crcs },
        );
    }

    /// An agent reads a block the control plane believes is in L1, as an
    /// agent reads a hit: only bytes whose checks pass are used, and those
    /// must be the saved ones.
    fn hit(&mut self) {
        let Some((replica, key)) = self.cp.pick(&mut self.rng, Tier::L1Dram) else { return };
        if self.read_l1(&key, replica.slot, replica.generation) {
            self.tally.hits_checked += 1;
        }
    }

    /// Reads block `key` in L1 slot `slot` as an agent reads a hit of
    /// `generation`: only bytes whose checks pass are used, and those must
    /// be the ones saved under the key. Whether they were used.
    fn read_l1(&self, key: &BlockKey, slot: u32, generation: u32) -> bool {
        let seed = self.seed;
        if slot >= L1_SLOTS {
            return false;
        }
        let bytes = self.node.slot_bytes(slot);
        let Ok(object) = ReadableObject::check(bytes, key, &reader()) else { return false };
        if object.header.meta().generation != generation || !object.segments().all(|segment| segment.is_ok()) {
            return false;
        }
        let saved = self.saved.get(key).unwrap_or_else(|| panic!("seed {seed}: an L1 hit of {key:?}, never saved"));
        assert_eq!(object.payload, &saved[..], "seed {seed}: an L1 hit served other bytes");
        true
    }

    /// How many blocks the agents saved, or tried to: block `n` of them is
    /// [`Simulation::read_published`]'s `n`.
    pub fn blocks(&self) -> u64 {
        self.next_block
    }

    /// Reads block `n` as an agent reads a hit where `published` says L1
    /// holds it (its slot and generation, from what the control plane
    /// published; `None`: not in L1): only bytes whose checks pass are
    /// used, and those must be the saved ones. Whether they were used.
    pub fn read_published(&mut self, n: u64, published: impl FnOnce(&BlockKey) -> Option<(u32, u32)>) -> bool {
        let key = key_of(n);
        let Some((slot, generation)) = published(&key) else { return false };
        let used = self.read_l1(&key, slot, generation);
        if used {
            self.tally.published_hits += 1;
        }
        used
    }

    /// A pass, then the control plane's reports and the agents' answers.
    fn settle(&mut self) {
        self.node.pass();
        self.cp.read(&mut self.tally, &mut self.control);
        if self.controlling {
            self.control.commands(self.node.clock.now_ns(), &mut self.commands);
        }
        for (request, message) in std::mem::take(&mut self.commands) {
            let answered = matches!(
                message,
                Message::MoveBlock(_) | Message::CopyBlock(_) | Message::EvictBlock(_) | Message::DrainRegion(_)
            );
            self.cp.send(request, &message, answered.then_some(Commanded::Control));
        }
        for agent in 0..AGENTS {
            while let Some(done) = self.agents[agent].port.complete() {
                let asked = self.agents[agent].asked.remove(&done.cookie).expect("an answer to a request");
                self.answered(agent, asked, done.result);
            }
        }
        self.peer_took();
    }

    /// The peer sends the node a block for a slot of its L1 (P→D, or a
    /// replica): one in twenty damaged on the way, one broken off halfway,
    /// one addressed to the node's last incarnation.
    fn peer_sends(&mut self) {
        let n = self.next_block;
        self.next_block += 1;
        let key = key_of(n);
        let payload = payload_of(n, self.seed);
        // Where the block sits at the peer.
        let meta = meta_of(key, payload.len(), (RegionId(0), 1), (7, 3));
        let mut bytes = vec![0; usize::try_from(object_bytes(payload.len() as u64)).expect("small")];
        encode_object(&meta, &payload, &mut bytes).expect("the object fits");
        bytes.truncate(crate::constants::STORED_HEADER_BYTES + payload.len());
        let arrival = match self.rng.below(20) {
            0 => Arrival::Damaged,
            1 => Arrival::Broken,
            2 => Arrival::Stale,
            _ => Arrival::Whole,
        };
        self.saved.insert(key, payload);
        let mut wire = self.node.wire.borrow_mut();
        let due_ns = wire.due(self.node.clock.now_ns());
        wire.arriving.push_back(Arriving { key, bytes, arrival, namespace: NAMESPACE.0, due_ns });
    }

    /// The control plane copies an L1 block of the node's to the peer;
    /// one copy in three it takes back a step later (before it went, on
    /// the wire, or after it landed: answered once whichever).
    fn copy_to_peer(&mut self) {
        if let Some(request_id) = self.take_back.take() {
            let cancel = Message::Cancel(crate::wire::message::Cancel { request_id });
            let request = self.cp.next_request;
            self.cp.next_request += 1;
            self.cp.send(request, &cancel, None);
        }
        let Some((replica, key)) = self.cp.pick(&mut self.rng, Tier::L1Dram) else { return };
        let target =
            ReplicaWire { node: link::PEER_NODE, region: 0, region_epoch: 1, slot: SLOT_ANY, generation: 0, ..replica };
        if self.rng.below(3) == 0 {
            self.take_back = Some(self.cp.next_request);
        }
        self.transfer(replica, target, key, Commanded::ToPeer, false);
    }

    /// What the peer took from the node must be the saved bytes; what the
    /// node took from the peer, only whole blocks for its own L1.
    fn peer_took(&mut self) {
        let seed = self.seed;
        let (received, landed) = {
            let mut wire = self.node.wire.borrow_mut();
            (core::mem::take(&mut wire.received), core::mem::take(&mut wire.landed))
        };
        for bytes in received {
            let key = crate::stored::decode_header(&bytes).map(|h| h.meta().key).expect("the peer got a header");
            let object = ReadableObject::check(&bytes, &key, &reader())
                .unwrap_or_else(|why| panic!("seed {seed}: the peer got a block that fails {why:?}"));
            assert!(object.segments().all(|s| s.is_ok()), "seed {seed}: the peer got a damaged segment");
            assert_eq!(object.payload, &self.saved[&key][..], "seed {seed}: the peer got other bytes");
            self.tally.peer_received += 1;
        }
        for (key, arrival, verdict) in landed {
            let published = verdict == Some(AckStatus::Landed);
            assert!(
                !published || arrival == Arrival::Whole,
                "seed {seed}: a block from the peer {arrival:?} was published ({verdict:?})"
            );
            match (arrival, published) {
                (_, true) => self.tally.peer_landed += 1,
                (Arrival::Damaged, false) => self.tally.peer_refused_damaged += 1,
                _ => {}
            }
            if !published {
                self.saved.remove(&key);
            }
        }
    }

    fn answered(&mut self, agent: usize, asked: Asked, result: Result<(u32, u32), AgentError>) {
        let seed = self.seed;
        match (asked, result) {
            (Asked::Reserve { key, damage, crcs }, Ok((slot, generation))) => {
                let payload = &self.saved[&key];
                // A misaddressed header names another generation of the slot.
                let named = if damage == Damage::Generation { generation.wrapping_add(1) } else { generation };
                let l1 = (RegionId(self.node.node.header.region), self.node.node.epoch);
                let meta = meta_of(key, payload.len(), l1, (slot, named));
                // SAFETY: the slot is reserved to this agent: nobody else
                // writes or reads it until it commits or aborts.
                let out = unsafe { self.node.node.region.slot_mut(slot) }.expect("a reserved slot");
                encode_object(&meta, payload, out).expect("the object fits its slot");
                if damage == Damage::Payload {
                    let at = crate::constants::STORED_HEADER_BYTES + index_below(&mut self.rng, payload.len());
                    out[at] ^= 0x40;
                }
                let commit = |cookie| AgentRequest::Commit { cookie, slot, generation, crcs };
                self.ask(agent, commit, Asked::Commit { key, damage, crcs });
            }
            (Asked::Reserve { key, .. }, Err(_)) => {
                self.saved.remove(&key);
            }
            (Asked::Commit { key, damage, crcs }, Ok(_)) => {
                if damage == Damage::Payload {
                    self.damaged.insert(key);
                }
                assert!(
                    damage == Damage::None || (damage == Damage::Payload && crcs == CrcOrigin::Slot),
                    "seed {seed}: a commit was published with {damage:?} (CRCs from {crcs:?})"
                );
                self.tally.saves += 1;
            }
            (Asked::Commit { key, damage, crcs }, Err(why)) => {
                self.saved.remove(&key);
                if damage == Damage::Generation || (damage == Damage::Payload && crcs == CrcOrigin::Unknown) {
                    assert_eq!(why, AgentError::Corrupt, "seed {seed}");
                    self.tally.refused_damaged += 1;
                }
            }
            (Asked::Load { .. }, Ok((slot, generation)))
                if self.node.node.table.arena().generation(slot) != Some(generation) =>
            {
                // Taken as a victim before the agent pinned it: an agent's
                // pin finds so and asks again.
                self.tally.loads_failed += 1;
            }
            (Asked::Load { key, from }, Ok((slot, generation))) => self.loaded(key, from, slot, generation),
            (Asked::Load { .. }, Err(_)) => self.tally.loads_failed += 1,
        }
    }

    /// A load from `from` answered `Ok` with `slot` of `generation`: the
    /// slot holds the block, every segment checks, and the bytes are the
    /// saved ones.
    fn loaded(&mut self, key: BlockKey, from: Tier, slot: u32, generation: u32) {
        let seed = self.seed;
        let bytes = self.node.slot_bytes(slot);
        let object = ReadableObject::check(bytes, &key, &reader())
            .unwrap_or_else(|why| panic!("seed {seed}: a load answered Ok into a slot that fails {why:?}"));
        assert_eq!(object.header.meta().generation, generation, "seed {seed}: the load's slot was taken again");
        assert!(object.segments().all(|s| s.is_ok()), "seed {seed}: a load answered Ok with a damaged segment");
        assert_eq!(object.payload, &self.saved[&key][..], "seed {seed}: a load served other bytes");
        self.tally.loads_ok += 1;
        if from == Tier::L3Object {
            self.tally.l3_loads_ok += 1;
        }
    }

    /// Runs until nothing is asked, commanded or in flight.
    fn quiesce(&mut self) {
        for _ in 0..200_000 {
            let asked = self.agents.iter().any(|a| !a.asked.is_empty());
            if !asked
                && self.cp.commanded.is_empty()
                && !self.node.node.poller.has_work()
                && self.node.node.table.stats().draining == 0
                && self.node.node.pool.l3_in_flight() == 0
                && self.node.node.l3_scan.is_none()
                && self.node.wire.borrow().idle()
            {
                return;
            }
            self.settle();
        }
        panic!(
            "seed {}: the node did not settle: {:?} commanded, {:?}",
            self.seed, self.cp.commanded, self.node.node.pool
        );
    }

    /// The node's process dies (`kind`) and starts again over the same
    /// disk, as its supervisor would start it: a new incarnation (epoch),
    /// arena, agents and link; L2 re-adopted by the scan a starting
    /// `lake-dp` makes; the view rebuilt from what the new node reports.
    /// After a process crash every L2 block acked before it is back (unless
    /// the scan's own reads failed, or it was published damaged); after a
    /// power loss, what was not flushed may be gone.
    fn restart(&mut self, kind: CrashKind) {
        let seed = self.seed;
        let acked: Vec<(ReplicaWire, BlockKey)> =
            self.cp.replicas.values().filter(|(r, _)| r.tier == Tier::L2Nvme as u8).copied().collect();
        let in_l3: Vec<BlockKey> =
            self.cp.replicas.values().filter(|(r, _)| r.tier == Tier::L3Object as u8).map(|(_, key)| *key).collect();
        self.count_l3();
        let mut disk = self.node.crash(kind);
        // The control plane sees the data plane's connection close.
        self.control.link_lost();
        let (geometry, epoch) = (self.node.node.geometry, self.node.node.epoch + 1);
        let mut clock = self.node.clock.now_ns();
        let mut now = || {
            clock += PASS_NS;
            clock
        };
        let found = crate::l2::readopt_over(&mut disk, &mut now, geometry, epoch, 0)
            .unwrap_or_else(|(what, e)| panic!("seed {seed}: re-adoption failed {what} the disk: {e}"));
        // The old node goes once the new one stands (their arenas' files
        // are apart).
        (self.node, self.cp, self.agents) = boot(seed, disk, self.store.as_ref(), &found);
        self.node.clock.0.set(clock);
        self.tally.restarts += 1;
        self.tally.readopted += found.adopted.len() as u64;
        self.quarantined = found.unreadable.len() as u64;
        self.settle();
        while self.node.node.l3_scan.is_some() {
            self.settle();
        }
        let l3_back = self.cp.replicas.values().filter(|(r, _)| r.tier == Tier::L3Object as u8).count();
        self.tally.l3_readopted += l3_back as u64;
        if self.store.as_ref().is_some_and(SimStore::faultless) {
            // The store is the source of truth: whatever the crash, every
            // block it held is found again.
            for key in in_l3 {
                assert!(
                    self.cp.replicas.values().any(|(r, k)| r.tier == Tier::L3Object as u8 && *k == key),
                    "seed {seed}: L3 block {key:?} is not back after a {kind:?}: {} blocks are",
                    l3_back
                );
            }
        }
        if kind == CrashKind::PowerLoss {
            return;
        }
        let at = |list: &[(u16, u32, String)], r: &ReplicaWire| {
            list.iter().any(|(file, slot, _)| (geometry.region(*file).0, *slot) == (r.region, r.slot))
        };
        for (replica, key) in acked {
            let back = self.cp.replicas.get(&(replica.tier, replica.region, replica.slot));
            let unreadable =
                found.unreadable.iter().any(|&(f, s, _)| (geometry.region(f).0, s) == (replica.region, replica.slot));
            let damaged = self.damaged.contains(&key) && at(&found.torn, &replica);
            assert!(
                back.is_some_and(|(r, k)| r.generation == replica.generation && *k == key) || unreadable || damaged,
                "seed {seed}: L2 block {key:?} acked at {replica:?} is not back after a process crash: {back:?}; \
                 torn {:?}, damaged {:?}",
                found.torn,
                found.damaged
            );
        }
    }

    /// Runs `steps` steps.
    pub fn run(&mut self, steps: u32) {
        for _ in 0..steps {
            self.step();
        }
    }

    /// The control.
    pub fn control(&self) -> &C {
        &self.control
    }

    /// Ends the run: everything asked is answered (the control's commands
    /// too), then the control stops, everything the view holds is
    /// evicted, and every L1 and L2 slot must be free again. What the run
    /// did, and the control.
    pub fn finish(mut self) -> (Tally, C) {
        // What the control still has to do for what happened (a duplicate
        // to evict, say) is done before it stops.
        self.quiesce();
        self.controlling = false;
        self.empty_and_check();
        self.count_l3();
        let stats = &self.node.node.pool.stats;
        self.tally.victims = stats.victims_clean + stats.victims_dropped;
        self.tally.corrupt_late = stats.commits_corrupt_late;
        (self.tally, self.control)
    }

    /// Counts the L3 objects this incarnation's reads found lost.
    fn count_l3(&mut self) {
        if let Some(stats) = self.node.node.pool.l3_stats() {
            self.tally.l3_lost += stats.lost;
        }
    }

    /// Evicts everything the control plane holds, and checks that every
    /// slot came back.
    fn empty_and_check(&mut self) {
        self.quiesce();
        // Corrupt blocks the check found went already; the rest go now.
        let all: Vec<_> = self.cp.replicas.values().copied().collect();
        for (replica, key) in all {
            let evicted = BlockEvicted { replica, key, reason: EvictReason::Capacity as u8, reserved: [0; 7] };
            self.cp.command(&Message::EvictBlock(evicted), Commanded::Evict);
        }
        self.quiesce();
        let seed = self.seed;
        assert!(self.cp.replicas.is_empty(), "seed {seed}: replicas outlived their eviction: {:?}", self.cp.replicas);
        let stats = self.node.node.table.stats();
        assert_eq!(stats.free[0], L1_SLOTS, "seed {seed}: L1 slots leaked: {stats:?}, {:?}", self.node.node.pool);
        // Slots the last re-adoption could not read stay out of use.
        assert_eq!(
            self.node.node.l2_slots.free_slots(),
            u64::from(L2_SLOTS) - self.quarantined,
            "seed {seed}: L2 slots leaked: {:?}",
            self.node.node.pool
        );
        assert_eq!(self.node.node.pool.l3_objects(), 0, "seed {seed}: L3 catalog entries leaked");
        if let Some(store) = self.store.as_ref().filter(|store| store.faultless()) {
            let left: Vec<String> = store.objects().keys().cloned().collect();
            assert!(
                left.is_empty(),
                "seed {seed}: objects outlived their eviction in the store: {left:?}\n{}",
                self.cp.log.join("\n")
            );
        }
    }
}

/// Faults for `seed`: every fourth seed a plain disk, the rest with the
/// disk's errors, short transfers, stale duplicates and reordering.
pub fn faults_for(seed: u64) -> SimFaults {
    if seed.is_multiple_of(4) {
        return SimFaults::none(20_000);
    }
    SimFaults {
        eio_ppm: 30_000,
        short_ppm: 20_000,
        fsync_eio_ppm: 10_000,
        stale_duplicate_ppm: 10_000,
        latency_min_ns: 5_000,
        latency_max_ns: 300_000,
        reorder: seed % 2 == 1,
    }
}

#[cfg(test)]
fn run_seed(seed: u64, steps: u32) -> Tally {
    let mut simulation = Simulation::new(seed, NoControl, true);
    simulation.run(steps);
    simulation.finish().0
}

#[test]
fn the_block_service_holds_over_many_seeds_of_the_simulated_disk() {
    let seeds: u64 = std::env::var("LAKE_SIM_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(1000);
    let first: u64 = std::env::var("LAKE_SIM_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(1);
    let mut total = Tally::default();
    for seed in first..first + seeds {
        let run = std::panic::catch_unwind(|| run_seed(seed, 300));
        let t = run.unwrap_or_else(|_| {
            panic!("seed {seed} failed; alone: LAKE_SIM_SEED={seed} LAKE_SIM_SEEDS=1 cargo test -p lake-dp --lib simulation")
        });
        total.add(&t);
    }
    println!("{seeds} seeds from {first}: {total:?}");
    // Every path was taken, many times over.
    assert!(total.saves > 10 * seeds && total.demotions > seeds && total.loads_ok > seeds, "{total:?}");
    assert!(total.refused_damaged > 0 && total.loads_failed > 0 && total.hits_checked > seeds, "{total:?}");
    assert!(total.victims > seeds && total.corrupt_late > 0, "{total:?}");
    assert!(total.write_backs > seeds && total.cp_promotions > seeds, "{total:?}");
    assert!(total.restarts > seeds / 4 && total.readopted > seeds, "{total:?}");
    assert!(total.l3_writes > seeds && total.l3_promotions > seeds / 2 && total.l3_loads_ok > seeds / 2, "{total:?}");
    assert!(total.l3_lost > 0 && total.l3_readopted > 0, "{total:?}");
    assert!(total.peer_copies > seeds && total.peer_received == total.peer_copies, "{total:?}");
    assert!(total.peer_landed > seeds / 2 && total.peer_refused_damaged > 0 && total.peer_cancelled > 0, "{total:?}");
}
