//! The block service under the deterministic simulator.
//!
//! The real [`Pool`], slot table, L2 slot map and poller run as the
//! runner runs them, pass after pass, over the simulated disk
//! ([`SimDisk`], with its faults) on a virtual clock. Around them:
//!
//! - **agents**: in-process ports (the real rings) on which the test
//!   saves (reserve, write the object, commit — some with a payload that
//!   does not match its CRCs) and loads from L2;
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
//! refused; and once everything is evicted, every L1 and L2 slot is free
//! again and the control plane's view is empty (no slot leaked, no block
//! the control plane was not told about).

use std::cell::Cell;
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::rc::Rc;
use std::sync::Arc;

use super::os::Wakeup;
use super::pool::{Pool, PoolShape};
use super::serve::Pass;
use super::{Node, RunnerConfig, RunnerOptions, RunnerPorts, RunnerStats};
use crate::agent::port::{AgentError, AgentPort, AgentRequest, CrcOrigin, port};
use crate::arena::Arena;
use crate::cplink::CpLink;
use crate::io::Clock;
use crate::l2::{L2Slots, Readoption};
use crate::model::key::BlockKey;
use crate::model::namespace::NamespaceId;
use crate::model::replica::{ObjectKind, Priority, RegionId, ReplicaWire, Tier};
use crate::op::{Event, L2Slot};
use crate::poller::Poller;
use crate::rng::SimRng;
use crate::sim::{CrashKind, SimDisk, SimFaults};
use crate::stored::{ObjectMeta, ReadableObject, Reader, encode_object, object_bytes};
use crate::wire::hello::{self, Identity};
use crate::wire::message::Role;
use crate::wire::message::{BlockEvicted, EvictReason, SLOT_ANY, Transfer};
use crate::wire::{FrameMeta, Limits, Message, WireError, decode_frame, encode_frame};

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

/// What an agent is waiting for, by cookie.
#[derive(Clone, Debug)]
enum Asked {
    Reserve { key: BlockKey, damage: Damage, crcs: CrcOrigin },
    Commit { key: BlockKey, damage: Damage, crcs: CrcOrigin },
    Load { key: BlockKey },
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

/// What the test's control plane is waiting for, by request id.
#[derive(Clone, Copy, Debug)]
enum Commanded {
    Demote,
    WriteBack,
    Promote,
    Evict,
    /// The [`Control`]'s.
    Control,
}

/// The control plane's end of the link, and its view of the node.
struct SimCp {
    end: UnixStream,
    input: Vec<u8>,
    have: usize,
    limits: Limits,
    version: u16,
    next_request: u64,
    /// The replicas reported committed and not evicted since, by tier and
    /// slot: what a control plane believes the node holds.
    replicas: BTreeMap<(u8, u16, u32), (ReplicaWire, BlockKey)>,
    commanded: BTreeMap<u64, Commanded>,
    /// Replicas evicted lately: what a control plane's view lagging
    /// behind the node still names.
    gone: Vec<(ReplicaWire, BlockKey)>,
    /// What crossed the link, for a failing seed's message.
    log: Vec<String>,
    seed: u64,
}

/// Counts a seed's run reached, so a test can see the run did something.
#[derive(Clone, Copy, Debug, Default)]
pub struct Tally {
    /// Saves committed.
    pub saves: u64,
    /// Damaged saves refused at commit.
    pub refused_damaged: u64,
    /// Loads answered `Ok`, their bytes checked.
    pub loads_ok: u64,
    /// Loads refused, failed, or taken before their pin.
    pub loads_failed: u64,
    /// L1 blocks read as hits, their bytes checked.
    pub hits_checked: u64,
    /// The simulation's demotions that ended well.
    pub demotions: u64,
    /// The simulation's evictions that ended well.
    pub evictions: u64,
    /// The simulation's write-backs that ended well.
    pub write_backs: u64,
    /// The simulation's promotions (L2 to L1) that ended well.
    pub cp_promotions: u64,
    /// The control's commands that ended well.
    pub controlled: u64,
    /// Marked blocks a save or a load took.
    pub victims: u64,
    /// Published commits the check found damaged afterwards.
    pub corrupt_late: u64,
    /// Crashes and restarts.
    pub restarts: u64,
    /// L2 blocks re-adopted after them.
    pub readopted: u64,
}

impl Tally {
    /// Adds `other`'s counts to these.
    pub fn add(&mut self, other: &Tally) {
        let Tally {
            saves,
            refused_damaged,
            loads_ok,
            loads_failed,
            hits_checked,
            demotions,
            evictions,
            write_backs,
            cp_promotions,
            controlled,
            victims,
            corrupt_late,
            restarts,
            readopted,
        } = *other;
        self.saves += saves;
        self.refused_damaged += refused_damaged;
        self.loads_ok += loads_ok;
        self.loads_failed += loads_failed;
        self.hits_checked += hits_checked;
        self.demotions += demotions;
        self.evictions += evictions;
        self.write_backs += write_backs;
        self.cp_promotions += cp_promotions;
        self.controlled += controlled;
        self.victims += victims;
        self.corrupt_late += corrupt_late;
        self.restarts += restarts;
        self.readopted += readopted;
    }
}

/// The virtual clock the simulated node's passes read.
#[derive(Clone, Debug, Default)]
struct VirtualClock(Rc<Cell<u64>>);

impl Clock for VirtualClock {
    fn now_ns(&self) -> u64 {
        self.0.get()
    }
}

/// The node's config: the sizes below, and the poller's defaults.
fn config_text(seed: u64, epoch: u64) -> String {
    format!(
        "[node]\nid = {NODE}\n\n[l1]\npath = \"/dev/shm/lake-sim-{}-{seed}-{epoch}\"\n\
         classes = [{{ payload_bytes = {}, slots = {L1_SLOTS} }}]\n\n\
         [l2]\npaths = [\"/nonexistent/lake-sim.lake\"]\nslots_per_file = {L2_SLOTS}\nslot_bytes = {SLOT_BYTES}\n\n\
         [poller]\nops_max = {OPS}\nbatch_max = {BUDGET}\n",
        std::process::id(),
        SLOT_BYTES - crate::constants::STORED_HEADER_BYTES as u64,
    )
}

/// A node as the runner runs it -- the same [`Node`], its passes made by
/// [`Node::pass`] -- over the simulated disk and a virtual clock, with no
/// transport, attach socket, L3 or signals: the agents' ports and the
/// control plane's link are its only ways in.
struct SimNode {
    node: Node<SimDisk, VirtualClock>,
    config: RunnerConfig,
    options: RunnerOptions,
    ports: RunnerPorts,
    stats: RunnerStats,
    clock: VirtualClock,
}

impl SimNode {
    /// A node of incarnation `found.epoch` over `disk`, serving what
    /// re-adoption `found` there (nothing on a new disk) and reporting it,
    /// as `Node::open` does.
    fn start(
        seed: u64,
        disk: SimDisk,
        found: &Readoption,
        agents: Vec<crate::agent::port::DpPort>,
        link: CpLink,
        wakeup: Arc<Wakeup>,
    ) -> Self {
        let epoch = found.epoch;
        let config = RunnerConfig::parse(&config_text(seed, epoch)).expect("the simulated node's config");
        let (arena, table) = Arena::create(&config.arena(epoch)).expect("the simulated node's arena");
        let region = arena.region().expect("its slots");
        let header = *arena.header();
        let geometry = config.l2().geometry();
        let poller = Poller::new(super::open::poller_config(&config, geometry, epoch), disk, Arc::clone(&region))
            .expect("the poller");
        let shape = PoolShape {
            node: NODE,
            epoch,
            l1_region: header.region,
            l1_slots: header.slots,
            geometry,
            ops: config.poller.ops_max,
        };
        let mut pool = Pool::new(&shape, agents, 0);
        for adopted in &found.adopted {
            pool.l2_written(L2Slot { file: adopted.file, slot: adopted.slot }, &adopted.meta);
        }
        let mut link = link;
        super::register_regions(&mut link, &config, &geometry, epoch, &header);
        super::link::report_readopted(&mut link, &geometry, NODE, found);
        let clock = VirtualClock::default();
        let node = Node {
            attach: None,
            peers_by_node: Vec::new(),
            transport: None,
            extra_fds: vec![-1; super::os::PARK_FDS_MAX],
            park_fds: Vec::new(),
            l3_scan: None,
            pool,
            l2_slots: L2Slots::from_readoption(geometry, found),
            poller,
            wakeup,
            link: Some(link),
            region,
            table,
            arena,
            tier: None,
            geometry,
            signals: None,
            selftest: None,
            events: vec![Event::placeholder(); config.poller.batch_max as usize],
            transfers: super::Transfers::new(),
            reconnect: super::Reconnect::new(),
            epoch,
            header,
            node_id: NODE,
            clock: clock.clone(),
            pace: super::serve::Pace::default(),
        };
        let (options, ports, stats) = (RunnerOptions::default(), RunnerPorts::default(), RunnerStats::default());
        Self { node, config, options, ports, stats, clock }
    }

    /// The process dies (`kind`): what was in flight lands as the disk
    /// lets it. The disk, to start the next incarnation on.
    fn crash(&mut self, kind: CrashKind) -> SimDisk {
        let disk = self.node.poller.backend_mut();
        // SAFETY: the ops in flight write into this node's region, which
        // lives until the node is dropped, after this.
        unsafe { disk.crash(kind) };
        std::mem::replace(disk, SimDisk::new(0, SimFaults::none(0), 1, 1, 0))
    }

    /// One pass, as `Node::serve` makes them, then the virtual clock on.
    fn pass(&mut self) {
        let now = self.clock.now_ns();
        let pass = self.node.pass(now, &self.config, &self.options, &self.ports, &mut self.stats);
        assert_ne!(pass, Pass::Done, "the simulated node is never asked to stop");
        self.node.pool.assert_invariants(&self.node.table, &self.node.l2_slots);
        self.stats.polls += 1;
        self.clock.0.set(now + PASS_NS);
    }

    /// The bytes of L1 slot `slot` as they are now.
    fn slot_bytes(&self, slot: u32) -> &[u8] {
        // SAFETY: one thread runs the whole simulation, so nothing writes
        // the slot while this borrow lives (the poller's simulated disk
        // copies only inside `pass`, which takes `&mut self`).
        unsafe { self.node.region.slot(slot) }.expect("a slot of the arena")
    }
}

fn key_of(n: u64) -> BlockKey {
    let mut key = [0x5e; 16];
    key[..8].copy_from_slice(&n.to_le_bytes());
    BlockKey(key)
}

fn reader() -> Reader {
    Reader { namespace: NAMESPACE, layout_fingerprint: LAYOUT, kind: ObjectKind::KvBlock }
}

impl SimCp {
    fn command(&mut self, message: &Message<'_>, what: Commanded) {
        let request = self.next_request;
        self.next_request += 1;
        self.send(request, message, Some(what));
    }

    /// Sends `message` under `request`; `what`: an answer is owed.
    fn send(&mut self, request: u64, message: &Message<'_>, what: Option<Commanded>) {
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
    fn mark(&mut self, marked: &BlockEvicted) {
        let meta = FrameMeta { version: self.version, flags: 0, request_id: 0, leader_term: 0 };
        let mut frame = [0u8; 512];
        let len = encode_frame(meta, &Message::MarkEvictable(*marked), &mut frame).expect("a mark frame");
        self.end.write_all(&frame[..len]).expect("the link's socket takes a mark");
        self.log.push(format!("cp -> dp: mark {marked:?}"));
    }

    /// Reads what the data plane reported, keeping the view, and hands
    /// every frame to `control`.
    fn read(&mut self, tally: &mut Tally, control: &mut dyn Control) {
        loop {
            match self.end.read(&mut self.input[self.have..]) {
                Ok(0) => panic!("the data plane closed the link"),
                Ok(n) => self.have += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("reading the link: {e}"),
            }
        }
        let mut at = 0;
        loop {
            let frame = match decode_frame(&self.input[at..self.have], &self.limits) {
                Ok(frame) => frame,
                Err(WireError::Incomplete { .. }) => break,
                Err(e) => panic!("the data plane sent a bad frame: {e:?}"),
            };
            at += frame.len();
            if matches!(frame.message, Message::BlockCommitted(_) | Message::BlockEvicted(_) | Message::TransferDone(_))
            {
                self.log.push(format!("dp -> cp {}: {:?}", frame.header.request_id, frame.message));
            }
            control.received(frame.header.request_id, &frame.message);
            match frame.message {
                Message::BlockCommitted(block) | Message::BlockReadopted(block) => {
                    let r = block.replica;
                    let old = self.replicas.insert((r.tier, r.region, r.slot), (r, block.key));
                    assert!(
                        old.is_none(),
                        "seed {}: a commit into a slot the view still holds: {old:?} then {block:?}",
                        self.seed
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
                    let what = self.commanded.remove(&frame.header.request_id);
                    assert!(what.is_some(), "seed {}: an answer to no command: {done:?}", self.seed);
                    if done.status == 0 {
                        match what {
                            Some(Commanded::Demote) => tally.demotions += 1,
                            Some(Commanded::WriteBack) => tally.write_backs += 1,
                            Some(Commanded::Promote) => tally.cp_promotions += 1,
                            Some(Commanded::Control) => tally.controlled += 1,
                            _ => tally.evictions += 1,
                        }
                    }
                }
                _ => {}
            }
        }
        self.input.copy_within(at..self.have, 0);
        self.have -= at;
    }

    /// A replica of `tier` the view holds, or one in eight times one it
    /// held once (a command from a view that lags).
    fn pick(&self, rng: &mut SimRng, tier: Tier) -> Option<(ReplicaWire, BlockKey)> {
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
fn link_pair(seed: u64, epoch: u64) -> (CpLink, SimCp) {
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
}

/// No control: the simulation's random commands alone.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoControl;

impl Control for NoControl {
    fn received(&mut self, _request: u64, _message: &Message<'_>) {}
    fn commands(&mut self, _now_ns: u64, _out: &mut Vec<(u64, Message<'static>)>) {}
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
    /// Whether the control still sends commands (not once the run ends).
    controlling: bool,
    commands: Vec<(u64, Message<'static>)>,
    agents: Vec<SimAgent>,
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
fn boot(seed: u64, disk: SimDisk, found: &Readoption) -> (SimNode, SimCp, Vec<SimAgent>) {
    let wakeup = Arc::new(Wakeup::new().expect("an eventfd"));
    let (agent_ports, dp_ports): (Vec<_>, Vec<_>) = (0..AGENTS).map(|_| port(PORT_DEPTH, Arc::clone(&wakeup))).unzip();
    let (link, cp) = link_pair(seed, found.epoch);
    let node = SimNode::start(seed, disk, found, dp_ports, link, wakeup);
    let agents =
        agent_ports.into_iter().map(|port| SimAgent { port, next_cookie: 1, asked: BTreeMap::new() }).collect();
    (node, cp, agents)
}

impl<C: Control> Simulation<C> {
    /// A node for `seed` (faults as [`faults_for`] gives them), commanded
    /// by `control` and, with `random_commands`, by the simulation too.
    pub fn new(seed: u64, control: C, random_commands: bool) -> Self {
        let file_bytes = usize::try_from(u64::from(L2_SLOTS) * SLOT_BYTES).expect("small");
        let disk = SimDisk::new(seed, faults_for(seed), OPS as usize, 1, file_bytes);
        let found = Readoption { epoch: EPOCH, ..Readoption::default() };
        let (node, cp, agents) = boot(seed, disk, &found);
        Self {
            node,
            cp,
            control,
            random_commands,
            controlling: true,
            commands: Vec::new(),
            agents,
            saved: BTreeMap::new(),
            damaged: std::collections::BTreeSet::new(),
            quarantined: 0,
            next_block: 0,
            seed,
            rng: SimRng::new(seed),
            tally: Tally::default(),
        }
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
        if commanding && self.rng.below(RESTART_ONE_IN) == 0 {
            let kind = if self.rng.below(4) == 0 { CrashKind::PowerLoss } else { CrashKind::Process };
            self.restart(kind);
        }
        match self.rng.below(100) {
            0..35 if room => self.save(agent),
            35..55 if commanding => {
                // Demoted (moved), written back (copied) or, from L2,
                // promoted by the control plane.
                let (from, to, what) = match self.rng.below(8) {
                    0..5 => (Tier::L1Dram, Tier::L2Nvme, Commanded::Demote),
                    5..7 => (Tier::L1Dram, Tier::L2Nvme, Commanded::WriteBack),
                    _ => (Tier::L2Nvme, Tier::L1Dram, Commanded::Promote),
                };
                if let Some((replica, key)) = self.cp.pick(&mut self.rng, from) {
                    let region = if to == Tier::L1Dram { self.node.node.header.region } else { replica.region };
                    let target = ReplicaWire { tier: to as u8, region, slot: SLOT_ANY, generation: 0, ..replica };
                    self.transfer(replica, target, key, what);
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
                let tier = if self.rng.below(2) == 0 { Tier::L1Dram } else { Tier::L2Nvme };
                if let Some((replica, key)) = self.cp.pick(&mut self.rng, tier) {
                    let evicted = BlockEvicted { replica, key, reason: EvictReason::Capacity as u8, reserved: [0; 7] };
                    self.cp.command(&Message::EvictBlock(evicted), Commanded::Evict);
                }
            }
            66..85 if room => {
                if let Some((source, key)) = self.cp.pick(&mut self.rng, Tier::L2Nvme) {
                    let load =
                        |cookie| AgentRequest::Load { cookie, key, source, priority: Priority::CriticalLoad, trace: 0 };
                    self.ask(agent, load, Asked::Load { key });
                }
            }
            85..100 => self.hit(),
            _ => {}
        }
        self.settle();
    }

    fn transfer(&mut self, source: ReplicaWire, target: ReplicaWire, key: BlockKey, what: Commanded) {
        let transfer = Transfer {
            source,
            target,
            key,
            deadline_unix_ns: 0,
            priority: Priority::WriteBack as u8,
            reserved: [0; 7],
        };
        let message = match what {
            Commanded::Demote => Message::MoveBlock(transfer),
            _ => Message::CopyBlock(transfer),
        };
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
        let bytes = self.node.slot_bytes(replica.slot);
        if let Ok(object) = ReadableObject::check(bytes, &key, &reader())
            && object.header.meta().generation == replica.generation
            && object.segments().all(|segment| segment.is_ok())
        {
            assert_eq!(object.payload, &self.saved[&key][..], "seed {}: an L1 hit served other bytes", self.seed);
            self.tally.hits_checked += 1;
        }
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
    }

    fn answered(&mut self, agent: usize, asked: Asked, result: Result<(u32, u32), AgentError>) {
        let seed = self.seed;
        match (asked, result) {
            (Asked::Reserve { key, damage, crcs }, Ok((slot, generation))) => {
                let payload = &self.saved[&key];
                let meta = ObjectMeta {
                    kind: ObjectKind::KvBlock,
                    key,
                    parent_key: BlockKey::NONE,
                    block_index: 0,
                    namespace: NAMESPACE,
                    layout_fingerprint: LAYOUT,
                    region: RegionId(self.node.node.header.region),
                    region_epoch: self.node.node.epoch,
                    slot,
                    generation: if damage == Damage::Generation { generation.wrapping_add(1) } else { generation },
                    committed_unix_ns: 0,
                    payload_len: payload.len() as u64,
                    segment_bytes: SEGMENT_BYTES,
                };
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
            (Asked::Load { key }, Ok((slot, generation))) => {
                let bytes = self.node.slot_bytes(slot);
                let object = ReadableObject::check(bytes, &key, &reader())
                    .unwrap_or_else(|why| panic!("seed {seed}: a load answered Ok into a slot that fails {why:?}"));
                assert_eq!(object.header.meta().generation, generation, "seed {seed}: the load's slot was taken again");
                assert!(object.segments().all(|s| s.is_ok()), "seed {seed}: a load answered Ok with a damaged segment");
                assert_eq!(object.payload, &self.saved[&key][..], "seed {seed}: a load served other bytes");
                self.tally.loads_ok += 1;
            }
            (Asked::Load { .. }, Err(_)) => self.tally.loads_failed += 1,
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
        let mut disk = self.node.crash(kind);
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
        (self.node, self.cp, self.agents) = boot(seed, disk, &found);
        self.node.clock.0.set(clock);
        self.tally.restarts += 1;
        self.tally.readopted += found.adopted.len() as u64;
        self.quarantined = found.unreadable.len() as u64;
        self.settle();
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
        let stats = &self.node.node.pool.stats;
        self.tally.victims = stats.victims_clean + stats.victims_dropped;
        self.tally.corrupt_late = stats.commits_corrupt_late;
        (self.tally, self.control)
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
}
